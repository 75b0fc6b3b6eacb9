"""``kvserve serve``: the OpenAI-compatible server on one engine."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.flags import VLLM_NOOP_NEUTRAL, VLLM_NOOPS
from kvserve.server.lifecycle import (
    draining_server,
    end_by,
    exit_when_the_engine_dies,
    interruptible_start,
)

if TYPE_CHECKING:
    from kvserve.engine.async_engine import ServingEngine
    from kvserve.server.auth import ApiKey
    from kvserve.server.state import ServerState

logger = logging.getLogger("kvserve.server")

SUMMARY = "serve a model over an OpenAI-compatible HTTP API"
DEFAULT_STATS_INTERVAL = 10.0  # seconds between stats lines, as vLLM's
# The shortest --engine-step-timeout (seconds) but 0: below it one real step is killed as
# hung (a 2,048-token step takes about 2 s on a 2-core machine, docs/engine-process.md)
MIN_STEP_TIMEOUT = 1.0
DESCRIPTION = ("Serve the model over /v1/completions, /v1/chat/completions and "
               "/v1/responses (with streaming), with Prometheus metrics at /metrics.")


def add_parser(subparsers: Any) -> None:
    from kvserve.core.router import DEFAULT_IMBALANCE_BOUND, ROUTER_POLICIES
    from kvserve.engine.engine_process import DEFAULT_STEP_TIMEOUT, STEP_TIMEOUT_TOKENS
    from kvserve.flags import add_command, add_model_flags, add_scheduler_flags, parse_bytes
    from kvserve.server.limits import (
        DEFAULT_MAX_PROMPTS_PER_REQUEST,
        DEFAULT_MAX_SEQUENCES_PER_REQUEST,
    )
    from kvserve.server.reasoning_parsers import PARSERS as REASONING_PARSERS
    from kvserve.server.response_store import DEFAULT_STORE_CAPACITY
    from kvserve.server.tool_parsers import PARSERS

    parser = add_command(subparsers, "serve", run, SUMMARY, DESCRIPTION)
    add_model_flags(parser)
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to bind (default: "
                       "127.0.0.1; use 0.0.0.0 to accept other machines)")
    group.add_argument("--port", type=int, default=8000, help="the port to listen on")
    group.add_argument("--root-path", default="", metavar="PATH",
                       help="the path prefix a proxy strips before forwarding (uvicorn's and "
                            "vLLM's root_path): the API is served without it, and the URLs "
                            "the server names carry it")
    group.add_argument("--ssl-keyfile", metavar="FILE",
                       help="serve HTTPS with this private key (PEM), with --ssl-certfile")
    group.add_argument("--ssl-certfile", metavar="FILE",
                       help="serve HTTPS with this certificate chain (PEM; it may hold the "
                            "key too)")
    group.add_argument("--served-model-name", nargs="+", metavar="NAME",
                       help="the model names clients may send, as vLLM takes them: the first "
                            "is the one /v1/models lists first and the metrics give; every one "
                            "is accepted as a request's model, and an answer gives the name it "
                            "was asked by (default: the model file's name)")
    group.add_argument("--api-key", action="extend", nargs="+", default=[], metavar="KEY",
                       help="operator keys (tenant 'operator': any priority with either "
                            "--priority-source, /v1/abort): several after one flag, as vLLM "
                            "takes them, or the flag repeated. Without it, the environment's "
                            "VLLM_API_KEY is one, as in vLLM")
    group.add_argument("--api-keys", metavar="FILE",
                       help="tenants' keys: one per line, or JSON/TOML with tenant, "
                            "most_urgent_priority, default_priority, admin, weight (a "
                            "key without tenant is tenant key-N, N its position)")
    group.add_argument("--priority-source", choices=("body", "key"), default="body",
                       help="body: a request may set its priority within its key's limit; "
                            "key: the key's default priority, the body may not choose "
                            "another (403)")
    group.add_argument("--max-request-body", type=parse_bytes, default="4MiB",
                       help="largest request body accepted (413 beyond; default 4MiB)")
    group.add_argument("--max-prompts-per-request", type=int,
                       default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                       help="most prompts in one completions request (400 beyond; default "
                            f"{DEFAULT_MAX_PROMPTS_PER_REQUEST})")
    group.add_argument("--max-sequences-per-request", type=int,
                       default=DEFAULT_MAX_SEQUENCES_PER_REQUEST,
                       help="most sequences (prompts x n) one request may queue (400 beyond; "
                            f"default {DEFAULT_MAX_SEQUENCES_PER_REQUEST})")
    group.add_argument("--allowed-origins", type=_json_strings, default=["*"], metavar="JSON",
                       help="browser origins allowed to call the API (CORS), a JSON list as "
                            "vLLM takes it (default [\"*\"]: any; []: no CORS headers)")
    group.add_argument("--allowed-methods", type=_json_strings, default=["*"], metavar="JSON",
                       help="CORS: methods allowed, a JSON list (default [\"*\"])")
    group.add_argument("--allowed-headers", type=_json_strings, default=["*"], metavar="JSON",
                       help="CORS: request headers allowed, a JSON list (default [\"*\"])")
    group.add_argument("--allow-credentials", action="store_true",
                       help="CORS: allow credentials (cookies, Authorization) from the allowed "
                            "origins")
    group.add_argument("--shutdown-timeout", type=_seconds, default=None, metavar="SECONDS",
                       help="vLLM's: on SIGTERM (or Ctrl-C) stop taking connections and let "
                            "the requests under way finish for at most this long, then abort "
                            "the rest (a stream ends with finish_reason abort); 0 aborts them "
                            "at once (vLLM's default). Default: wait for them all")
    group.add_argument("--config", metavar="YAML",
                       help="vLLM's: a YAML file of these flags (max-model-len: 4096, "
                            "model: PATH, ...), read as if given here; a flag given on the "
                            "command line wins")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="vLLM's: every stream ends with a usage chunk, asked for or not")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="vLLM's: usage has prompt_tokens_details.cached_tokens, the "
                            "prompt tokens read from the prefix cache")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="vLLM's: logprobs name each token token_id:N (a request's "
                            "return_tokens_as_token_ids false still names them by text)")
    group.add_argument("--max-logprobs", type=int, default=20, metavar="N",
                       help="the most logprobs, top_logprobs or prompt_logprobs a request may "
                            "ask for (400 beyond, naming the limit); -1: the whole "
                            "vocabulary (default 20, as vLLM's)")
    group.add_argument("--enable-responses-store", action="store_true",
                       help="keep /v1/responses answers (store: true, OpenAI's default) in "
                            "memory for GET /v1/responses/{id} and previous_response_id, "
                            "each readable with its tenant's keys only; also vLLM's "
                            "VLLM_ENABLE_RESPONSES_API_STORE=1. Off: nothing is kept, as in "
                            "vLLM (docs/responses-api.md)")
    group.add_argument("--responses-store-size", type=int, default=None, metavar="N",
                       help="with the store on, how many responses it keeps per tenant, "
                            f"the oldest dropped first (default {DEFAULT_STORE_CAPACITY})")
    group.add_argument("--responses-store-memory", type=parse_bytes, default=None,
                       metavar="SIZE",
                       help="with the store on, the most its responses take per tenant, "
                            "as JSON (e.g. 64MiB; default 256MiB), the oldest dropped first")
    chat = parser.add_argument_group("chat (vLLM's flags)")
    chat.add_argument("--chat-template", metavar="FILE_OR_TEMPLATE",
                      help="a Jinja chat template replacing the model's: a file, or the "
                           "template itself (text holding { or a newline), as vLLM takes it")
    chat.add_argument("--response-role", default="assistant", metavar="ROLE",
                      help="the role of a chat answer's message (vLLM's; default assistant)")
    chat.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                      metavar="{" + ",".join(REASONING_PARSERS) + "}",
                      help="split a thinking model's <think>...</think> off its chat answer "
                           "as the message's reasoning (vLLM's): deepseek_r1 (DeepSeek R1 "
                           "and its Llama distills, QwQ: the answer starts thinking), qwen3 "
                           "(thinking may be off)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="serve tool_choice \"auto\" (the default with tools): the tools go "
                           "to the chat template and the calls the model writes are parsed "
                           "out of its answer by --tool-call-parser (vLLM's)")
    chat.add_argument("--tool-call-parser", choices=PARSERS, metavar="{" + ",".join(PARSERS)
                      + "}",
                      help="how the model writes its tool calls: hermes (<tool_call>{...}"
                           "</tool_call>: Hermes, Qwen), llama3_json ({\"name\", "
                           "\"parameters\"}: Llama 3.1-3.3), mistral ([TOOL_CALLS] then the "
                           "calls: Mistral, Mixtral, Nemo, Magistral), pythonic "
                           "([get_weather(city=\"Oslo\")]: Llama 3.2 and 4, ToolACE); with "
                           "--enable-auto-tool-choice")
    defaults = parser.add_argument_group("sampling defaults (vLLM's flags)")
    defaults.add_argument("--generation-config", default="auto", metavar="{auto,vllm,DIR}",
                          help="auto (default, as vLLM): the model directory's "
                               "generation_config.json gives temperature, top_p, top_k, "
                               "min_p, repetition_penalty and max_new_tokens (the default "
                               "max_tokens) to the requests that do not set them (a GGUF, the "
                               "bundled model too, has none); vllm: none; DIR: that "
                               "directory's file. The boot log names the defaults applied")
    defaults.add_argument("--override-generation-config", type=_json_object, metavar="JSON",
                          help="sampling defaults that override or extend the generation "
                               "config's, in its names, e.g. '{\"temperature\": 0.5}'")
    logs = parser.add_argument_group("logging (vLLM's flags)")
    logs.add_argument("--log-stats-interval", type=float, default=None,
                      help=f"seconds between stats lines; 0: none (default "
                           f"{DEFAULT_STATS_INTERVAL:g})")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no stats lines (--log-stats-interval 0)")
    logs.add_argument("--enable-log-requests", action="store_true",
                      help="log each request as it is queued: its id, tenant, prompts' "
                           "lengths and sampling settings (never the prompt text)")
    logs.add_argument("--disable-log-requests", action="store_true",
                      help="the default (requests are not logged); taken so a vLLM command "
                           "line runs unchanged")
    logs.add_argument("--max-log-len", type=int, default=None, metavar="N",
                      help="taken so a vLLM command line runs unchanged: vLLM cuts the "
                           "prompts it logs to N characters; prompts are never logged here "
                           "(--enable-log-requests logs their lengths), so it changes nothing")
    logs.add_argument("--uvicorn-log-level", default="info",
                      choices=("critical", "error", "warning", "info", "debug", "trace"),
                      help="uvicorn's log level: at info (the default, as vLLM's) an access "
                           "line for each HTTP request and the shutdown's progress")
    logs.add_argument("--disable-uvicorn-access-log", action="store_true",
                      help="no access line for each HTTP request")
    logs.add_argument("--disable-access-log-for-endpoints", type=_paths, default=(),
                      metavar="PATHS",
                      help="vLLM's: no access line for these paths, comma-separated (e.g. "
                           "/health,/metrics,/ping: a probe's every few seconds)")
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="run the scheduler and the model in a process of their own, as "
                            "vLLM V1 runs its EngineCore, so HTTP and the engine never share "
                            "one interpreter lock; text is made in the server's process "
                            "(default: on; --no-engine-process steps the engine on a thread "
                            "of the server's process, docs/engine-process.md)")
    group.add_argument("--engine-step-timeout", type=float, default=None, metavar="SECONDS",
                       help="kill an engine process (a replica: restart it) that finishes no "
                            f"step in this long while it has work, as hung (default: "
                            f"{DEFAULT_STEP_TIMEOUT:g} per {STEP_TIMEOUT_TOKENS} tokens of "
                            "--max-num-batched-tokens, at least "
                            f"{DEFAULT_STEP_TIMEOUT:g}; 0: never; docs/engine-process.md)")
    record = parser.add_argument_group("recording (docs/recording.md)")
    record.add_argument("--record", metavar="DIR",
                        help="record what the server sees into DIR (a trace in the "
                             "simulator's format and each engine's step log), for kvserve "
                             "simulate --trace DIR and kvserve whatif DIR")
    record.add_argument("--record-prompts", choices=("none", "hashes", "ids"),
                        default="hashes",
                        help="how prompts are recorded: hashes (default: the chained block "
                             "hashes of the prefix cache, no text), ids (token ids), none "
                             "(lengths only)")
    record.add_argument("--record-max-file-size", type=parse_bytes, default="64MiB",
                        help="start a new file of a series past this size (default 64MiB)")
    parallel = parser.add_argument_group("data parallel")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                          help="engine replicas, each with its own scheduler, KV pool and "
                               "model, behind this one server")
    parallel.add_argument("--data-parallel-backend", "-dpb", choices=("mp", "ray"),
                          default="mp",
                          help="mp: local processes; ray: Ray actors on the cluster "
                               "RAY_ADDRESS names, or on a local Ray instance")
    parallel.add_argument("--router", choices=ROUTER_POLICIES, default=None,
                          help="how a request picks its replica (default least-loaded; "
                               "prefix-affinity: the replica "
                               "its leading prompt blocks were last sent to, within a load "
                               "bound)")
    parallel.add_argument("--router-imbalance-bound", type=int, default=None, metavar="SCORE",
                          help="prefix-affinity leaves a replica whose load score exceeds "
                               "the least-loaded one's by more than this (default "
                               f"{DEFAULT_IMBALANCE_BOUND}, as kvserve simulate's and plan's)")
    parallel.add_argument("--threads-per-replica", type=int, default=None, metavar="T",
                          help="torch threads in each replica (default: the CPUs split "
                               "evenly among the replicas; with one replica, torch's "
                               "default)")
    add_scheduler_flags(parser)
    noops = parser.add_argument_group("vLLM's flags that do nothing here (each given logs "
                                      "why; docs/vllm-compat.md)")
    for names, keywords, why in VLLM_NOOPS:
        neutral = VLLM_NOOP_NEUTRAL.get(names[0].lstrip("-").replace("-", "_"))
        taken = f"taken at {neutral} only" if neutral is not None else "taken"
        noops.add_argument(*names, **keywords, help=f"vLLM's; {taken}, does nothing: {why}")


def _paths(text: str) -> tuple[str, ...]:
    """'/health,/metrics' -> the paths (each begins with /)."""
    paths = tuple(part.strip() for part in text.split(",") if part.strip())
    bad = [path for path in paths if not path.startswith("/")]
    if not paths or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: give paths that begin with /, separated "
                                         "by commas (e.g. /health,/metrics)")
    return paths


def _json_strings(text: str) -> list[str]:
    """A JSON list of strings ('["https://a.example", "*"]'), as vLLM's CORS flags take it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON list of strings, like "
                                         '\'["https://app.example"]\'')
    return value


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object ('{"temperature": 0.5}'), as vLLM's --override-generation-config."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object, like "
                                         '\'{"temperature": 0.5}\'')
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds >= 0")
    return value


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kvserve.engine.engine_process import LOG_FORMAT
    from kvserve.flags import configure_logging

    configure_logging(LOG_FORMAT)  # VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING
    from kvserve.server.app import Cors, build_app

    sockets: list[socket.socket] = []
    with interruptible_start():
        state = build_state(args, before_engine=lambda: sockets.append(
            bind_socket(args.host, args.port)))
    cors = Cors(tuple(args.allowed_origins), tuple(args.allowed_methods),
                tuple(args.allowed_headers), args.allow_credentials)
    interval = DEFAULT_STATS_INTERVAL if args.log_stats_interval is None \
        else args.log_stats_interval
    app = build_app(state, log_stats_interval=0.0 if args.disable_log_stats else interval,
                    cors=cors)
    _listen(sockets, args, state)  # before "serving": a second server on the port is refused
    scheme = "https" if args.ssl_certfile else "http"
    logger.info("serving %s on %s://%s:%d%s", state.model_name, scheme, args.host, args.port,
                args.root_path)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not state.keys.enabled:
        logger.warning("listening on %s without API keys: anyone who can reach it may use "
                       "it, abort requests and start recordings into any directory this "
                       "server may write (give --api-key or --api-keys)", args.host)
    timeout = args.shutdown_timeout
    server = draining_server(uvicorn, uvicorn_config(app, args), state, timeout)
    died = exit_when_the_engine_dies(server, state.engine)
    # Ctrl-C: uvicorn shuts down cleanly, then raises it again, unless SIGINT came ignored
    # from the parent (a job in the background); either way the server ends by it (130), as
    # a Ctrl-C while starting does (QA: 0)
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=sockets)
    if died.is_set():
        return 1
    if server.stop_signal == signal.SIGINT:
        end_by(signal.SIGINT)
    return 0


def _listen(sockets: list[socket.socket], args: argparse.Namespace, state: Any) -> None:
    """Listen on the address bound before the load. Two servers started together on one
    port both bind it (SO_REUSEADDR, which a restart needs); the second to listen is
    refused here, in one line, its engine stopped (QA: a traceback from uvicorn, named an
    error "writing the output")."""
    from kvserve.flags import CLIError

    try:
        for sock in sockets:
            sock.listen(2048)  # uvicorn's backlog
    except OSError as error:
        for sock in sockets:
            sock.close()
        try:
            asyncio.run(state.engine.stop())
        except Exception:  # the refusal is the message; the stop's failure is logged
            logger.exception("stopping the engine after the refusal failed")
        raise CLIError(f"cannot listen on {args.host}:{args.port}: "
                       f"{error.strerror or error} (another server took the address while "
                       f"this one loaded)") from None


def uvicorn_config(app: Any, args: argparse.Namespace) -> Any:
    """uvicorn's configuration from serve's flags (the address, logging, vLLM's root path
    and TLS files)."""
    import uvicorn

    timeout = args.shutdown_timeout
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log,
                            root_path=args.root_path, ssl_keyfile=args.ssl_keyfile,
                            ssl_certfile=args.ssl_certfile,
                            # a backstop: the aborts below end every request well before
                            timeout_graceful_shutdown=None if timeout is None
                            else timeout + 30)
    access = logging.getLogger("uvicorn.access")  # after uvicorn.Config, which sets it up
    for earlier in [f for f in access.filters if isinstance(f, AccessLogFilter)]:
        access.removeFilter(earlier)  # one server's (tests build several in a process)
    access.addFilter(AccessLogFilter(args.disable_access_log_for_endpoints or (),
                                     args.root_path or ""))
    return config


# A key in a query string (the dashboard's ?key=, a browser's only way to send one)
_QUERY_KEY = re.compile(r"(?<=[?&])key=[^&]*")


class AccessLogFilter(logging.Filter):
    """uvicorn's access lines: those of some paths dropped (--disable-access-log-for-endpoints),
    as given or under ``root_path`` (--root-path), which uvicorn's lines carry (QA:
    /llm/health was logged); a ``key=`` in a query string masked (the dashboard pass: the
    server's own log held the operator's key from the dashboard's URL)."""

    def __init__(self, paths: tuple[str, ...], root_path: str = "") -> None:
        super().__init__()
        root = root_path.rstrip("/")
        self.paths = frozenset(path.rstrip("/") or "/" for path in (  # /metrics/ is /metrics
            *paths, *(root + path for path in paths if root)))

    def filter(self, record: logging.LogRecord) -> bool:
        # uvicorn's access record: (client, method, path with its query, version, status)
        args = record.args
        if not (isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str)):
            return True
        path, _, query = args[2].partition("?")
        if (path.rstrip("/") or "/") in self.paths:
            return False
        if "key=" in query:
            record.args = (*args[:2], _QUERY_KEY.sub("key=***", args[2]), *args[3:])
        return True


def _check_tls(args: argparse.Namespace) -> None:
    """--ssl-keyfile and --ssl-certfile load as uvicorn will load them, checked before the
    model loads: a missing file or a key that does not match is one line, not a traceback
    after the load."""
    import ssl

    from kvserve.flags import CLIError

    if args.ssl_keyfile is None and args.ssl_certfile is None:
        return
    if args.ssl_certfile is None:
        raise CLIError("--ssl-keyfile needs --ssl-certfile (the certificate for the key)")
    for flag, path in (("--ssl-certfile", args.ssl_certfile), ("--ssl-keyfile", args.ssl_keyfile)):
        if path is not None and not Path(path).is_file():
            raise CLIError(f"{flag} {path}: no such file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(args.ssl_certfile,
                                                                args.ssl_keyfile)
    except (ssl.SSLError, OSError) as error:
        raise CLIError(f"--ssl-certfile {args.ssl_certfile}: cannot load the certificate "
                       f"and key: {error.strerror or error}") from None


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host``:``port``, not yet listening (uvicorn listens once the app
    is ready; until then a client is refused, not left hanging), so an address that cannot
    be had is a one-line error before the model loads, as vLLM binds before its engine
    starts. CLIError naming the address and why."""
    from kvserve.flags import CLIError

    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as error:
        why = error.strerror if isinstance(error, socket.gaierror) else "not a host name"
        raise CLIError(f"--host {host!r}: cannot resolve it: {why}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise CLIError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    return sock


@dataclasses.dataclass
class _Setup:
    """``serve``'s flags, checked: what the engine and the server's state are built from."""

    keys: list[ApiKey]
    names: list[str]  # --served-model-name's
    template: str | None  # --chat-template's, in place of the model's
    sampling_defaults: dict[str, Any]
    max_tokens_cap: int | None  # vLLM's override_max_tokens
    parallel: bool  # data-parallel replicas (or one Ray replica)
    step_timeout: float | None
    build_args: dict[str, Any]  # the engine's


def build_state(args: argparse.Namespace,
                before_engine: Callable[[], None] | None = None) -> ServerState:
    """The server's state from ``serve``'s flags: every flag checked first (CLIError), then
    ``before_engine`` (``run`` binds the address there), then the engine built."""
    setup = _check_flags(args)
    if before_engine is not None:
        before_engine()
    serving = _start_engine(args, setup)
    return _server_state(args, setup, serving)


def _check_flags(args: argparse.Namespace) -> _Setup:
    """Every flag of ``serve`` checked, before anything starts: CLIError for the first bad
    one."""
    from kvserve.flags import CLIError, engine_args, resolve_model_option
    from kvserve.server.recorder import RecordingError, check_directory, check_options

    resolve_model_option(args)
    _check_model_not_swallowed(args)
    template = _chat_template(args.chat_template) if args.chat_template is not None else None
    if template is None:
        _check_model_chat_template(args.model)
    defaults = _sampling_defaults(args)
    if args.record is not None and not args.record.strip():  # the flags pass: the cwd
        raise CLIError("--record needs a directory, got ''")
    try:  # before anything else: a bad directory or option fails at once
        check_options(args.record_prompts, args.record_max_file_size)
        if args.record is not None:
            check_directory(args.record)
    except RecordingError as error:
        raise CLIError(str(error)) from None
    keys = _api_keys(args)
    settings = engine_args(args)
    _apply_tenants(keys, settings)
    _check_request_flags(args)
    if args.priority_source == "key" and not keys:
        raise CLIError("--priority-source key takes each request's priority from its API key: "
                       "give --api-key or --api-keys")
    names = _served_names(args)
    if not args.response_role.strip():
        raise CLIError("--response-role must not be empty")
    policy = settings.get("scheduling_policy", "fcfs")
    urgent = list(dict.fromkeys(k.tenant for k in keys if k.default_priority != 0))
    if policy != "priority" and urgent:
        raise CLIError(f"API keys with a non-zero default_priority ({', '.join(urgent)}) need "
                       "--scheduling-policy priority")
    if not 0 < args.port < 65536:
        raise CLIError(f"--port {args.port} is not a port number")
    if args.root_path and not args.root_path.startswith("/"):
        raise CLIError(f"--root-path {args.root_path!r}: a path starts with /")
    _check_tls(args)
    _vllm_noops(args)
    _check_scheduler_flags(settings)
    parallel = _check_replica_flags(args)
    step_timeout = _step_timeout(args, _reachable_budget(settings, args.model))
    _check_answer_flags(args)
    build_args = {"record_events": True, "max_logprobs": args.max_logprobs, **settings}
    return _Setup(keys, names, template, defaults, _max_tokens_cap(args, defaults), parallel,
                  step_timeout, build_args)


def _api_keys(args: argparse.Namespace) -> list[ApiKey]:
    """The operator's keys (--api-key, or VLLM_API_KEY) and the keys file's tenants."""
    from kvserve.flags import CLIError
    from kvserve.server.auth import KEY_RULE, KeyFileError, is_valid_key, load_keys, operator_key

    for key in args.api_key:  # as a keys file's keys are checked
        if not is_valid_key(key):
            raise CLIError(f"--api-key: a key must be {KEY_RULE}")  # never shown (QA)
    keys = [operator_key(key) for key in args.api_key or _env_api_key()]
    try:
        if args.api_keys:
            keys += load_keys(args.api_keys)
    except KeyFileError as error:
        raise CLIError(str(error)) from None
    operators = {key.key for key in keys if key.operator}
    for index, key in enumerate(k for k in keys if not k.operator):  # the tenants pass: the
        if key.key in operators:  # operator's won, silently: admin, any priority, its cache
            given = "--api-key" if args.api_key else "VLLM_API_KEY"
            raise CLIError(f"{args.api_keys}: key #{index + 1} (tenant {key.tenant!r}) is also "
                           f"an operator key ({given}); give the tenant another key")
    return keys


def _apply_tenants(keys: list[ApiKey], settings: dict[str, Any]) -> None:
    """Known tenants' engine settings: their caches apart unless the operator says not (T7),
    and the keys file's weights priced by VTC."""
    from kvserve.flags import CLIError
    from kvserve.server.auth import KeyFileError, tenant_weights

    if not keys:
        return
    settings.setdefault("prefix_cache_scope", "tenant")
    try:
        weights = tenant_weights(keys)
    except KeyFileError as error:
        raise CLIError(str(error)) from None
    if weights and settings.get("tenant_fairness", "off") != "vtc":
        shown = ", ".join(f"{tenant}={weight:g}" for tenant, weight in weights)
        raise CLIError(f"the keys file gives tenants weights ({shown}), which only "
                       "price the fair share: add --tenant-fairness vtc, or drop "
                       "the weights")
    if weights:
        settings["tenant_weights"] = weights


def _check_request_flags(args: argparse.Namespace) -> None:
    """The limits on a request and the request log's flags."""
    from kvserve.flags import CLIError

    for name in ("max_prompts_per_request", "max_sequences_per_request"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_request_body < 1024:
        raise CLIError(f"--max-request-body {args.max_request_body}: every request would get "
                       "413; give at least 1KiB")
    if args.enable_log_requests and args.disable_log_requests:
        raise CLIError("--enable-log-requests and --disable-log-requests contradict each "
                       "other; give one")
    if args.log_stats_interval is not None and not args.log_stats_interval >= 0:  # NaN too
        raise CLIError(f"--log-stats-interval must be >= 0 seconds (0: no stats lines), got "
                       f"{args.log_stats_interval}")
    if args.disable_log_stats and args.log_stats_interval is not None:  # the flags pass
        raise CLIError("--disable-log-stats and --log-stats-interval contradict each other; "
                       "give one")


def _check_replica_flags(args: argparse.Namespace) -> bool:
    """The data-parallel flags; whether the server runs replicas behind a router (and
    ``args.router`` set to the one it uses)."""
    from kvserve.engine.data_parallel import check_local_replicas
    from kvserve.flags import CLIError

    if args.data_parallel_size < 1:
        raise CLIError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    try:
        check_local_replicas(args.data_parallel_size, args.data_parallel_backend)
    except ValueError as error:
        raise CLIError(str(error)) from None
    if args.threads_per_replica is not None and args.threads_per_replica < 1:
        raise CLIError(f"--threads-per-replica must be >= 1, got {args.threads_per_replica}")
    parallel = args.data_parallel_size > 1 or args.data_parallel_backend == "ray"
    cpus = os.cpu_count() or 1
    if not parallel and (args.threads_per_replica or 0) > cpus:  # replicas warn their own
        logger.warning("--threads-per-replica %d on %d CPUs: the engine's threads will take "
                       "turns (slower than %d)", args.threads_per_replica, cpus, cpus)
    if not parallel and args.router is not None:
        raise CLIError(f"--router {args.router} picks a replica: it needs "
                       "--data-parallel-size 2 or more")
    bound = args.router_imbalance_bound
    if bound is not None and not parallel:
        raise CLIError("--router-imbalance-bound bounds the router's choice of a replica: "
                       "it needs --data-parallel-size 2 or more")
    if bound is not None and args.router != "prefix-affinity":  # QA: told to add replicas
        raise CLIError(f"--router-imbalance-bound bounds --router prefix-affinity, not "
                       f"{args.router or 'least-loaded (the default)'}: give --router "
                       "prefix-affinity")
    if bound is not None and bound < 0:
        raise CLIError(f"--router-imbalance-bound must be >= 0, got {bound}")
    if parallel and not args.engine_process:
        raise CLIError("--no-engine-process steps one engine on a thread of the server; "
                       "data-parallel replicas are engine processes: drop it")
    args.router = args.router or "least-loaded"
    return parallel


def _check_answer_flags(args: argparse.Namespace) -> None:
    """What an answer may carry: logprobs, tool calls, the Responses API's store."""
    from kvserve.flags import CLIError

    if args.max_logprobs < -1:
        raise CLIError(f"--max-logprobs must be >= 0 (or -1: the whole vocabulary), got "
                       f"{args.max_logprobs}")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise CLIError("--enable-auto-tool-choice needs --tool-call-parser NAME (how the "
                       "model writes its calls), as in vLLM")
    if args.responses_store_size is not None and args.responses_store_size < 1:
        raise CLIError(f"--responses-store-size must be >= 1, got {args.responses_store_size}")
    if args.responses_store_memory is not None and args.responses_store_memory < 1:
        raise CLIError("--responses-store-memory must be at least one byte, got "
                       f"{args.responses_store_memory}")
    for flag, value in (("--responses-store-size", args.responses_store_size),
                        ("--responses-store-memory", args.responses_store_memory)):
        if value is not None and not _responses_store_on(args):  # the flags pass: ignored
            raise CLIError(f"{flag} bounds the responses store, which is off: give "
                           "--enable-responses-store (or VLLM_ENABLE_RESPONSES_API_STORE=1)")


def _start_engine(args: argparse.Namespace, setup: _Setup) -> ServingEngine:
    """The serving engine: data-parallel replicas, one engine process, or an engine stepped
    on a thread of the server (--no-engine-process)."""
    from kvserve.core import ConfigError
    from kvserve.engine.async_engine import AsyncEngine
    from kvserve.engine.data_parallel import replicas_on_this_machine
    from kvserve.engine.engine_process import EngineStartError
    from kvserve.engine.llm import build_engine, check_engine_args
    from kvserve.flags import CLIError

    build_args = setup.build_args
    serving: ServingEngine
    try:
        if setup.parallel or args.engine_process:  # refused here, before any process starts
            here = replicas_on_this_machine(args.data_parallel_size,
                                            args.data_parallel_backend) if setup.parallel else 1
            check_engine_args(args.model, here, **build_args)
        if setup.parallel:
            serving = _data_parallel(args, build_args, setup.step_timeout)
        elif args.engine_process:
            serving = _engine_process(args.model, build_args, args.threads_per_replica,
                                      setup.step_timeout)
        else:
            if args.threads_per_replica:  # the engine's thread shares this process's torch
                import torch  # (QA: taken and ignored here)

                torch.set_num_threads(args.threads_per_replica)
            serving = AsyncEngine(build_engine(args.model, **build_args))
    except (ConfigError, ValueError, FileNotFoundError, EngineStartError) as error:
        raise CLIError(str(error).splitlines()[0]) from error
    if setup.template is not None:  # the server's tokenizer renders every chat
        serving.info.tokenizer.set_chat_template(setup.template)
        logger.info("chat template: --chat-template's, in place of the model's")
    return serving


def _server_state(args: argparse.Namespace, setup: _Setup,
                  serving: ServingEngine) -> ServerState:
    """The server's state around ``serving``, configured by the flags."""
    from kvserve.flags import CLIError
    from kvserve.server.auth import KeyRing
    from kvserve.server.limits import FanOutLimits
    from kvserve.server.recorder import RecordingError
    from kvserve.server.state import ServerState

    names = setup.names
    name = names[0] if names else _model_name(args.model)
    state = ServerState(serving, name, KeyRing(setup.keys), args.priority_source,
                        args.max_request_body)
    state.served_model_names = tuple(names or (name,))
    if not names and args.model is not None and args.model != name:
        # vLLM serves the model under the path as given: a client moved from it sends that
        state.model_aliases = (args.model,)
    state.sampling_defaults = setup.sampling_defaults
    state.max_tokens_cap = setup.max_tokens_cap
    state.max_logprobs = serving.info.tokenizer.vocab_size if args.max_logprobs == -1 \
        else args.max_logprobs
    state.response_role = args.response_role
    state.fan_out = FanOutLimits(args.max_prompts_per_request, args.max_sequences_per_request)
    state.record_prompts = args.record_prompts
    state.record_max_file_bytes = args.record_max_file_size
    state.model_id = _model_name(args.model)
    state.log_requests = args.enable_log_requests
    state.force_include_usage = args.enable_force_include_usage
    state.prompt_tokens_details = args.enable_prompt_tokens_details
    state.tokens_as_ids = args.return_tokens_as_token_ids
    state.responses = _response_store(args)
    if args.reasoning_parser is not None:
        from kvserve.server.reasoning_parsers import make_parser as make_reasoning_parser

        state.reasoning_parser = make_reasoning_parser(args.reasoning_parser)
        logger.info("reasoning: <think>...</think> split off chat answers (%s)",
                    args.reasoning_parser)
    if args.tool_call_parser is not None and not args.enable_auto_tool_choice:
        logger.warning("--tool-call-parser %s parses the calls of tool_choice auto, which "
                       "needs --enable-auto-tool-choice too: auto stays refused",
                       args.tool_call_parser)  # vLLM takes it alone too
    elif args.tool_call_parser is not None:
        from kvserve.server.tool_parsers import make_parser

        state.tool_parser = make_parser(args.tool_call_parser)
        logger.info("tool_choice auto: the model's calls parsed by %s", args.tool_call_parser)
    if args.record is not None:
        from kvserve.server.recorder import Recorder

        try:
            state.recorder = Recorder(args.record, serving.info, prompts=args.record_prompts,
                                      max_file_bytes=args.record_max_file_size,
                                      model_name=name, model_id=state.model_id,
                                      num_engines=getattr(serving, "num_replicas", 1),
                                      router=getattr(serving, "router", None))
        except RecordingError as error:  # the directory changed since the check
            asyncio.run(serving.stop())  # no engine process may outlive the refusal
            raise CLIError(str(error)) from None
    return state


def _response_store(args: argparse.Namespace) -> Any:
    """The Responses API's store (a ResponseStore): on with --enable-responses-store or
    vLLM's VLLM_ENABLE_RESPONSES_API_STORE (1 or true)."""
    from kvserve.server.response_store import (
        DEFAULT_STORE_BYTES,
        DEFAULT_STORE_CAPACITY,
        ResponseStore,
    )

    enabled = _responses_store_on(args)
    size = args.responses_store_size or DEFAULT_STORE_CAPACITY
    if enabled:
        logger.info("responses store: on, the latest %d /v1/responses answers of each "
                    "tenant kept in memory%s", size, "" if args.enable_responses_store else
                    " (VLLM_ENABLE_RESPONSES_API_STORE)")
    return ResponseStore(enabled, size, args.responses_store_memory or DEFAULT_STORE_BYTES)


def _responses_store_on(args: argparse.Namespace) -> bool:
    from_env = os.environ.get("VLLM_ENABLE_RESPONSES_API_STORE", "").strip().lower()
    return args.enable_responses_store or from_env in ("1", "true")


def _check_model_chat_template(model: Any) -> None:
    """The model's own chat template compiles (CLIError naming what does not, before the
    model loads): a broken chat_template.jinja made every chat a 500 (QA)."""
    from kvserve.flags import CLIError
    from kvserve.model.loader import ModelNotFoundError
    from kvserve.model.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(model)
    except (ModelNotFoundError, OSError, ValueError):
        return  # the engine's loading names what is wrong with the model
    if not tokenizer.chat_template:  # QA (prompts pass): said at the first chat only
        logger.warning("the model has no chat template: chat completions, the Responses API "
                       "and /tokenize of messages answer 400 (give one with --chat-template "
                       "FILE); completions are served")
        return
    try:
        tokenizer.compiled_chat_template()
    except ValueError as error:
        message = str(error).removeprefix("the chat template ")
        raise CLIError(f"the model's chat template {message}; give one that is with "
                       "--chat-template FILE") from None


def _chat_template(value: str) -> str:
    """--chat-template as vLLM reads it: a file's text, or else the template itself where
    the value looks like one (it holds a brace or a newline); checked as Jinja here, before
    the model loads."""
    from kvserve.flags import CLIError
    from kvserve.model.tokenizer import compile_chat_template

    path = Path(value)
    if path.is_file():
        try:
            template = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CLIError(f"--chat-template {value}: cannot read it: {error}") from None
    elif any(char in value for char in "{}\n"):
        template = value
    else:
        raise CLIError(f"--chat-template {value!r}: no such file, and not a template (a "
                       "Jinja template holds {{ or {%)")
    try:
        compile_chat_template(template)
    except ValueError as error:
        raise CLIError(f"--chat-template: {error}") from None
    return template


def _vllm_noops(args: argparse.Namespace) -> None:
    """vLLM's flags that do nothing here (VLLM_NOOPS): one line each given, saying why; a
    value other than the neutral one is refused with what to do instead."""
    from kvserve.flags import CLIError, vllm_refusal

    for names, _, why in VLLM_NOOPS:
        dest = names[0].lstrip("-").replace("-", "_")
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        neutral = VLLM_NOOP_NEUTRAL.get(dest)
        if neutral is not None and value != neutral:
            raise CLIError(vllm_refusal(names[0], str(value)))
        if isinstance(value, list):
            value = " ".join(value)
        shown = names[0] if value is True else f"{names[0]} {value}"
        logger.info("%s: vLLM's, does nothing here: %s", shown, why)
    if args.max_log_len is not None:  # a logging flag, declared with them (QA: no line)
        logger.info("--max-log-len %d: vLLM's, does nothing here: vLLM cuts the prompts it "
                    "logs; prompts are never logged here (--enable-log-requests logs their "
                    "lengths)", args.max_log_len)


def _sampling_defaults(args: argparse.Namespace) -> dict[str, Any]:
    """--generation-config and --override-generation-config's sampling defaults, logged
    (:mod:`kvserve.model.generation_config`); CLIError naming what cannot be one."""
    from kvserve.flags import CLIError
    from kvserve.model.generation_config import sampling_defaults

    try:
        defaults = sampling_defaults(args.model, args.generation_config,
                                     args.override_generation_config)
    except ValueError as error:
        raise CLIError(str(error)) from None
    if defaults:
        shown = ", ".join(f"{name}={value}" for name, value in defaults.items())
        source = "--override-generation-config" if args.generation_config == "vllm" else \
            "the model's generation_config.json" + (
                " and --override-generation-config" if args.override_generation_config else "")
        logger.info("sampling defaults from %s, for the requests that do not set them: %s "
                    "(--generation-config vllm: none)", source, shown)
    return defaults


def _max_tokens_cap(args: argparse.Namespace, defaults: dict[str, Any]) -> int | None:
    """vLLM's override_max_tokens: a max_new_tokens read from ``--generation-config DIR``,
    or given by ``--override-generation-config``, caps every request's max_tokens; one read
    from the model's own file (auto) is only chat's default."""
    if args.generation_config not in ("auto", "vllm") or \
            "max_new_tokens" in (args.override_generation_config or {}):
        return defaults.get("max_tokens")
    return None


def _env_api_key() -> list[str]:
    """vLLM's VLLM_API_KEY: the operator key when no --api-key is given (an empty value:
    none). Logged as coming from there, never shown, nor named in an error."""
    from kvserve.flags import CLIError
    from kvserve.server.auth import KEY_RULE, is_valid_key

    key = os.environ.get("VLLM_API_KEY", "")
    if not key:
        return []
    if not is_valid_key(key):
        raise CLIError(f"VLLM_API_KEY: a key must be {KEY_RULE}")
    logger.info("API key: an operator key from VLLM_API_KEY (no --api-key given)")
    return [key]


def _check_model_not_swallowed(args: argparse.Namespace) -> None:
    """--served-model-name and --api-key take every word after them (vLLM's nargs='+'), so
    ``--api-key KEY MODEL`` reads the model as a second key and serves the bundled model.
    With no model given, a value that is a model on disk, or reads as a model path (a GGUF
    file's name; for a served name, a path from / . or ~: the docs check, a mistyped path
    served the bundled model under it), is that mistake: refused, with the order that
    works. A hub's ``org/model`` stays a name."""
    from kvserve.flags import CLIError

    if args.model is not None:
        return
    for flag, values in (("--served-model-name", args.served_model_name or ()),
                         ("--api-key", args.api_key)):
        for value in values:
            path = Path(value)
            if (path.suffix.lower() == ".gguf" and path.is_file()) or \
                    (path / "config.json").is_file():
                what = "is a model on disk"
            elif path.suffix.lower() == ".gguf" or (flag == "--served-model-name" and (
                    value in (".", "..") or value.startswith(("/", "./", "../", "~")))):
                what = "looks like a model path"
            else:
                continue
            raise CLIError(f"{flag} took {value!r}, which {what}: {flag} takes every word "
                           f"after it, so give the model first (kvserve serve {value} "
                           f"{flag} ...)")


def _served_names(args: argparse.Namespace) -> list[str]:
    """--served-model-name's names, checked; [] when none was given."""
    from kvserve.flags import CLIError

    names = list(args.served_model_name or ())
    if any(not name.strip() for name in names):
        raise CLIError("--served-model-name must not be empty")
    return list(dict.fromkeys(names))  # a name given twice is one name


def _reachable_budget(settings: dict[str, Any], model: str | None) -> int | None:
    """The most tokens a step can schedule (the budget, or max_num_seqs full-length
    sequences where fewer), with max_model_len the model's context where no flag gives it
    (its header alone is read) and the budget as the engine will settle it (raised to
    max_model_len with chunked prefill off); warned as vLLM warns where the budget is past
    that (the flags pass: 10^14 was taken silently, and the step watchdog's default, which
    grows with it, never fired). None where the model cannot be read: its load says why."""
    from kvserve.core import ConfigError
    from kvserve.flags import scheduler_config
    from kvserve.model.loader import model_config_from_path

    try:  # (the scheduler's keys alone: the review, the engine's made every call fail)
        length = settings.get("max_model_len") or \
            model_config_from_path(model).max_position_embeddings
        config = scheduler_config({**settings, "max_model_len": length})
    except (OSError, ValueError, KeyError, ConfigError):  # the load or the engine names it
        return settings.get("max_num_batched_tokens")
    most = config.max_num_seqs * config.max_model_len
    if config.max_num_batched_tokens > most:
        logger.warning("max_num_batched_tokens %d is past max_num_seqs x max_model_len (%d): "
                       "no step schedules more than that", config.max_num_batched_tokens, most)
    return min(config.max_num_batched_tokens, most)


def _check_scheduler_flags(settings: dict[str, Any]) -> None:
    """The scheduler and cache flags' ranges, checked before the model loads (the engine
    checks them again, with the model's context length as max_model_len's default); flags
    that shape only what another turns on are refused without it (the flags pass: taken and
    ignored)."""
    from kvserve.core import ConfigError
    from kvserve.core.config import CACHE_AWARE_POLICIES
    from kvserve.flags import CLIError, cache_config, scheduler_config

    policy = settings.get("scheduling_policy", "fcfs")
    if "lpm_max_queue" in settings and policy not in CACHE_AWARE_POLICIES:
        raise CLIError(f"--lpm-max-queue bounds the queue that lpm and dfs-weight sort: "
                       f"give --scheduling-policy lpm or dfs-weight, not {policy}")
    if "session_ttl_s" in settings and not settings.get("max_session_kv"):
        raise CLIError("--session-ttl-s is how long a session holds KV: sessions are off "
                       "(give --max-session-kv)")

    trial = {"max_model_len": max(2, settings.get("max_num_batched_tokens", 2)), **settings}
    try:
        scheduler_config(trial)
        cache_config(settings, 1)
    except ConfigError as error:
        raise CLIError(str(error)) from None


def _step_timeout(args: argparse.Namespace,
                  max_num_batched_tokens: int | None) -> float | None:
    """The step watchdog's timeout (None: off); CLIError for a value it cannot take."""
    from kvserve.core import SchedulerConfig
    from kvserve.engine.engine_process import default_step_timeout
    from kvserve.flags import CLIError

    if args.engine_step_timeout is None:
        return default_step_timeout(max_num_batched_tokens or
                                    SchedulerConfig.max_num_batched_tokens)
    if not 0 <= args.engine_step_timeout < float("inf"):  # NaN fails too
        raise CLIError(f"--engine-step-timeout must be a finite number of seconds >= 0 (0: "
                       f"never), got {args.engine_step_timeout}")
    if 0 < args.engine_step_timeout < MIN_STEP_TIMEOUT:  # the flags pass: a unit mistake
        raise CLIError(f"--engine-step-timeout is in seconds: {args.engine_step_timeout:g} s "
                       f"is less than one real step takes; give at least {MIN_STEP_TIMEOUT:g} "
                       "(0: never)")
    if args.engine_step_timeout and not args.engine_process:
        raise CLIError("--engine-step-timeout watches an engine process: it cannot be used "
                       "with --no-engine-process (a step on the server's thread cannot be "
                       "killed)")
    return args.engine_step_timeout or None


def _engine_spec(model: str | None, engine_args: dict[str, Any], threads: int | None,
                 step_timeout: float | None) -> Any:
    import functools

    from kvserve.engine.engine_process import EngineSpec
    from kvserve.engine.llm import build_engine, portable_model

    return EngineSpec(functools.partial(build_engine, portable_model(model), **engine_args),
                      threads=threads, step_timeout=step_timeout)


def _engine_process(model: str | None, engine_args: dict[str, Any],
                    threads: int | None, step_timeout: float | None) -> Any:
    """The engine in a spawned process; the tokenizer here, for the server's own use."""
    from kvserve.engine.engine_process import ProcessEngine
    from kvserve.model.tokenizer import load_tokenizer

    return ProcessEngine(_engine_spec(model, engine_args, threads, step_timeout),
                         load_tokenizer(model))


def _data_parallel(args: argparse.Namespace, engine_args: dict[str, Any],
                   step_timeout: float | None) -> Any:
    """N replicas (local processes or Ray actors) behind the router."""
    from kvserve.core.router import DEFAULT_IMBALANCE_BOUND, make_router
    from kvserve.engine.data_parallel import (
        DataParallelEngine,
        default_threads,
        replica_launchers,
        warn_oversubscribed,
    )
    from kvserve.model.tokenizer import load_tokenizer

    size = args.data_parallel_size
    threads = args.threads_per_replica or default_threads(size)
    launchers = replica_launchers(size, args.data_parallel_backend, args.device, threads)
    chosen = DEFAULT_IMBALANCE_BOUND if args.router_imbalance_bound is None \
        else args.router_imbalance_bound
    bound = f", imbalance bound {chosen}" if args.router == "prefix-affinity" else ""
    logger.info("%d engine replicas (%s), %d threads each, router %s%s", size,
                args.data_parallel_backend, threads, args.router, bound)
    warn_oversubscribed(size, threads, args.data_parallel_backend)
    return DataParallelEngine(_engine_spec(args.model, engine_args, threads, step_timeout),
                              load_tokenizer(args.model), launchers,
                              make_router(args.router, size, imbalance_bound=chosen))


def _model_name(model: str | None) -> str:
    if model is None:
        return "SmolLM2-135M-Instruct"
    path = Path(model)
    return path.stem if path.suffix else path.name
