"""Factories for the server tests: a tiny random-weight model with the real tokenizer (loads in
about a second, steps in milliseconds), and a live server on a free 127.0.0.1 port."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from kvserve.engine.engine import Engine
from kvserve.model.config import ModelConfig

TINY = ModelConfig(name="tiny", vocab_size=49152, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                   max_position_embeddings=2048, eos_token_id=2)


@functools.cache
def tokenizer() -> Any:
    from kvserve.model.tokenizer import load_tokenizer

    return load_tokenizer(None)


def tiny_model_dir(path: Any, chat_template: str | None = None,
                   tokenizer_config: dict[str, Any] | None = None,
                   generation_config: dict[str, Any] | None = None) -> str:
    """A Hugging Face directory of the TINY shapes with the bundled tokenizer and no weights,
    for ``--load-format dummy`` (loads in about a second): its ``chat_template.jinja``,
    ``tokenizer_config.json`` and ``generation_config.json`` as given (none when None)."""
    import json
    from pathlib import Path

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": TINY.vocab_size, "hidden_size": TINY.hidden_size,
        "intermediate_size": TINY.intermediate_size, "num_hidden_layers": TINY.num_layers,
        "num_attention_heads": TINY.num_heads, "num_key_value_heads": TINY.num_kv_heads,
        "max_position_embeddings": TINY.max_position_embeddings,
        "eos_token_id": TINY.eos_token_id, "torch_dtype": "float32"}))
    tokenizer().save(folder / "tokenizer.json")
    if chat_template is not None:
        (folder / "chat_template.jinja").write_text(chat_template)
    if tokenizer_config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return str(folder)


def make_engine(num_kv_blocks: int = 256, **settings: Any) -> Engine:
    from kvserve.engine.llm import build_engine

    settings.setdefault("max_model_len", 1024)
    return build_engine(TINY, tokenizer=tokenizer(), num_kv_blocks=num_kv_blocks,
                        record_events=True, **settings)


def wait_for(condition: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
    """Poll ``condition`` until it holds; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(0.01)


def engine_spec(delay: float = 0.0, **settings: Any) -> Any:
    """How an engine process builds the tiny engine (``delay``: seconds per step at least),
    on one passive thread so the suite's processes do not fight for the two cores."""
    from kvserve.engine.engine_process import EngineSpec

    factory = functools.partial(slow_engine, delay, **settings) if delay else \
        functools.partial(make_engine, **settings)
    return EngineSpec(factory, threads=1, wait_policy="PASSIVE")


class LiveServer:
    """A kvserve app on a free 127.0.0.1 port, served by uvicorn on a thread. The engine runs
    on a thread of this process (``engine``, or one built from ``engine_settings``), or, given
    ``spec``, in an engine process of its own; or ``serving`` is the ready engine (data
    parallel replicas); or ``state`` is the whole server's (``kvserve serve``'s build_state),
    its engine and keys included."""

    def __init__(self, engine: Engine | None = None, *, model_name: str = "tiny",
                 keys: list[Any] | None = None, priority_source: str = "body",
                 max_body_bytes: int | None = None, spec: Any | None = None,
                 serving: Any | None = None, cors: Any | None = None,
                 state: Any | None = None, **engine_settings: Any) -> None:
        import socket
        import threading

        import uvicorn

        from kvserve.engine.async_engine import AsyncEngine
        from kvserve.engine.engine_process import ProcessEngine
        from kvserve.server.app import build_app
        from kvserve.server.auth import KeyRing
        from kvserve.server.state import DEFAULT_MAX_BODY_BYTES, ServerState

        if state is not None:
            self.engine = getattr(state.engine, "engine", None)
            serving = state.engine
        elif serving is not None:
            self.engine = None
        elif spec is not None:
            self.engine = None
            serving = ProcessEngine(spec, tokenizer())
        else:
            self.engine = engine or make_engine(**engine_settings)
            serving = AsyncEngine(self.engine)
        self.state = state or ServerState(serving, model_name, KeyRing(keys or []),
                                          priority_source,
                                          max_body_bytes or DEFAULT_MAX_BODY_BYTES)
        self.app = build_app(self.state) if cors is None else build_app(self.state, cors=cors)
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run,
                                       kwargs={"sockets": [self.socket]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, what="the server to start")

    @property
    def scheduler(self) -> Any:
        assert self.engine is not None, "the engine runs in another process"
        return self.engine.scheduler

    def idle(self) -> bool:
        """No request left anywhere and the whole pool free."""
        stats = self.state.engine.stats
        return (stats.num_running == 0 and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_blocks and not self.state.groups)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.socket.close()

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlowExecutor:
    """Wraps a runner so every step takes at least ``delay`` seconds: a request stays queued,
    prefilling or decoding long enough for a test to act while it is there."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner = inner
        self.delay = delay
        self.began = 0  # steps begun: a test waits for one that read a delay it set

    def execute(self, scheduler_output: Any) -> Any:
        self.began += 1
        time.sleep(self.delay)
        return self.inner.execute(scheduler_output)


def slow_engine(delay: float = 0.01, **settings: Any) -> Engine:
    engine = make_engine(**settings)
    engine.executor = SlowExecutor(engine.executor, delay)
    return engine


class PoisonedExecutor(SlowExecutor):
    """Fails any step that admits a request whose prompt begins with ``poison``: a request
    that takes down whatever engine runs it."""

    def __init__(self, inner: Any, delay: float, poison: int) -> None:
        super().__init__(inner, delay)
        self.poison = poison

    def execute(self, scheduler_output: Any) -> Any:
        if any(new.token_ids[:1] == [self.poison]
               for new in scheduler_output.scheduled_new_reqs):
            raise RuntimeError("a poisoned request")
        return super().execute(scheduler_output)


def poisoned_engine(poison: int, delay: float = 0.01, **settings: Any) -> Engine:
    engine = make_engine(**settings)
    engine.executor = PoisonedExecutor(engine.executor, delay, poison)
    return engine


def metric_values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics text -> {(sample name, sorted labels): value}, by prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def rendezvous_engine(folder: str, count: int, **settings: Any) -> Engine:
    """An engine process that is ready only once ``count`` of them are loading at once (each
    leaves its pid in ``folder``; ValueError after a minute): replicas launched one after
    another never are."""
    import os
    from pathlib import Path

    Path(folder, str(os.getpid())).touch()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < count:
        if time.monotonic() > deadline:
            raise ValueError("the other replicas never started loading")
        time.sleep(0.05)
    return make_engine(**settings)


def loading_engine(folder: str, fail_if_named: str | None = None) -> Engine:
    """An engine process that leaves its pid in ``folder`` and then loads for ever (a
    minute), or, in the process named ``fail_if_named``, fails as soon as another one is
    loading (its pid is in ``folder``; at most 30 s): a replica that failed before the other
    had even started left nothing loading to stop, and the test that stops it raced."""
    import multiprocessing
    import os
    from pathlib import Path

    if multiprocessing.current_process().name == fail_if_named:
        deadline = time.monotonic() + 30
        while not os.listdir(folder) and time.monotonic() < deadline:
            time.sleep(0.01)
        raise ValueError("this replica's settings are refused")
    Path(folder, str(os.getpid())).touch()
    time.sleep(60)
    raise ValueError("loaded for a minute")


def relaunch_loads_for_ever(folder: str, **settings: Any) -> Engine:
    """An engine process whose first life (per process name) builds as usual and whose later
    ones (relaunches after a death) leave their pid in ``folder`` and load for ever (a
    minute)."""
    import multiprocessing
    import os
    from pathlib import Path

    first = Path(folder, multiprocessing.current_process().name)
    if not first.exists():
        first.touch()
        return make_engine(**settings)
    Path(folder, f"relaunch-{os.getpid()}").touch()
    time.sleep(60)
    raise ValueError("loaded for a minute")


class ScriptedExecutor:
    """Wraps a runner so every request's answer is ``script`` (token ids), then EOS,
    whatever the model samples: what a model trained for a format (thinking, tool calls)
    would write."""

    def __init__(self, inner: Any, script: list[int], eos: int) -> None:
        self.inner = inner
        self.script = script
        self.eos = eos
        self.made: dict[str, int] = {}

    def execute(self, scheduler_output: Any) -> Any:
        output = self.inner.execute(scheduler_output)
        for request_id, ids in output.sampled_token_ids.items():
            for index in range(len(ids)):
                at = self.made.get(request_id, 0)
                ids[index] = self.script[at] if at < len(self.script) else self.eos
                self.made[request_id] = at + 1
        return output


def scripted_engine(text: str, **settings: Any) -> Engine:
    """The tiny engine whose every answer is ``text``."""
    engine = make_engine(**settings)
    engine.executor = ScriptedExecutor(engine.executor, tokenizer().encode(text),
                                       TINY.eos_token_id)
    return engine
