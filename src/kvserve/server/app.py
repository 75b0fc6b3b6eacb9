"""The FastAPI app: OpenAI endpoints, health, version, metrics, the operator's abort and the
release of a multi-turn session."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import disable_created_metrics
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from kvserve import __version__
from kvserve.core.sessions import SessionNotFound
from kvserve.engine.async_engine import EngineDeadError, ServingEngine
from kvserve.engine.data_parallel import RETRY_WHILE_RESTARTING_S
from kvserve.server import admin, dashboard, generation, responses_api
from kvserve.server.errors import APIError, bad_request
from kvserve.server.metrics import HttpMetrics
from kvserve.server.prompts import chat_ids, check_token_ids
from kvserve.server.protocol import (
    DetokenizeRequest,
    TokenizeRequest,
    check_session_id,
    parse_body,
)
from kvserve.server.state import ServerState, is_request_id
from kvserve.server.stats_log import StatsLogger, log_boot

logger = logging.getLogger("kvserve.server")


@dataclass(frozen=True)
class Cors:
    """Which browser origins may call the API (vLLM's --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials, with its defaults: any origin, no credentials).
    No origins: no CORS headers at all."""

    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


def build_app(state: ServerState, *, log_stats_interval: float = 0.0,
              cors: Cors = Cors()) -> FastAPI:
    """The app for one engine; the engine thread (and the periodic stats line, every
    ``log_stats_interval`` seconds when > 0) starts and stops with the app."""
    stats_logger = StatsLogger(state)
    # No *_created series (vLLM 0.32 has them; docs/vllm-compat.md says why not here).
    # prometheus-client's switch is process-wide, so it is thrown when a server is built,
    # never on import.
    disable_created_metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        log_boot(state)
        state.engine.start()
        if state.recorder is not None:  # serve --record DIR: from the first request on
            state.recorder.attach(state.engine)
            state.recorder.start()
            logger.info("recording into %s (prompts: %s)", state.recorder.directory,
                        state.recorder.prompts)
        task = asyncio.ensure_future(stats_logger.run(log_stats_interval)) \
            if log_stats_interval > 0 else None
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
            await state.engine.stop()
            if state.recorder is not None:
                state.recorder.close()

    app = FastAPI(title="kvserve", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.state.kvserve = state
    app.add_middleware(HttpMetrics, metrics=state.metrics)  # CORS preflights: not counted
    if cors.origins:  # answers a browser's preflight before any route or key check
        # a browser's script may read the headers a client acts on: the request's id, a
        # 503's Retry-After (CORS hides all but a few by default)
        app.add_middleware(CORSMiddleware, allow_origins=list(cors.origins),
                           allow_methods=list(cors.methods), allow_headers=list(cors.headers),
                           allow_credentials=cors.credentials,
                           expose_headers=["X-Request-Id", "Retry-After"])

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        response = error.response()
        given = request.headers.get("x-request-id")  # echoed on refusals too, as vLLM does
        if is_request_id(given):
            response.headers.setdefault("X-Request-Id", given)
        if error.status == 401:  # RFC 9110: a 401 names the scheme it wants
            response.headers.setdefault("WWW-Authenticate", "Bearer")
        return response

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        message = "not found" if error.status_code == 404 else str(error.detail)
        response = APIError(error.status_code, f"{request.method} {request.url.path}: "
                                               f"{message}").response()
        response.headers.update(error.headers or {})  # a 405's Allow (RFC 9110)
        return response

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, error: EngineDeadError) -> Response:
        return generation.engine_dead_error(state, error).response()

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, error: ClientDisconnect) -> Response:
        # A client hanging up mid-body is ordinary; one debug line each, never a traceback,
        # so a crowd of them cannot flood the log.
        logger.debug("%s %s: the client left while sending the body", request.method,
                     request.url.path)
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        # Only a bug gets here; the traceback is logged by the server after this answer.
        return APIError(500, f"internal error: {type(error).__name__}").response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError) -> Response:
        return bad_request(str(error)).response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generation.handle(state, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generation.handle(state, request, chat=True)

    @app.get("/load")
    async def load(request: Request) -> Response:
        """vLLM's load endpoint: the generation requests under way (a load balancer's
        least-loaded choice)."""
        return JSONResponse({"server_load": len(state.groups)})

    @app.post("/invocations")
    async def invocations(request: Request) -> Response:
        """vLLM's SageMaker route: a chat or a completion, told apart by the body."""
        state.keys.authenticate(request.headers.getlist("authorization"))
        body = await state.read_json(request)
        if not isinstance(body, dict) or ("messages" in body) == ("prompt" in body):
            raise bad_request("/invocations takes a chat completion's body ('messages') or "
                              "a completion's ('prompt'): send exactly one of them")
        return await generation.handle(state, request, "messages" in body, body)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        return await responses_api.create(state, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(request: Request, response_id: str) -> Response:
        return responses_api.retrieve(state, request, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def response_input_items(request: Request, response_id: str) -> Response:
        return responses_api.input_items(state, request, response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await responses_api.delete(state, request, response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        return await responses_api.cancel(state, request, response_id)

    def model_card(name: str) -> dict[str, Any]:
        # vLLM's card: root is the model itself (under --served-model-name, its own name)
        return {"id": name, "object": "model", "created": int(state.started),
                "owned_by": "kvserve", "root": state.model_id or state.model_name,
                "parent": None, "max_model_len": state.max_model_len,
                # vLLM's card lists what a key may do with the model: everything served here
                "permission": [{"id": f"modelperm-{name}",
                                "object": "model_permission", "created": int(state.started),
                                "allow_create_engine": False, "allow_sampling": True,
                                "allow_logprobs": True, "allow_search_indices": False,
                                "allow_view": True, "allow_fine_tuning": False,
                                "organization": "*", "group": None, "is_blocking": False}]}

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        state.keys.authenticate(request.headers.getlist("authorization"))
        # one card per served name, the first first, as vLLM lists them
        return JSONResponse({"object": "list",
                             "data": [model_card(name) for name in state.model_names]})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        state.keys.authenticate(request.headers.getlist("authorization"))
        state.check_model(model_id)
        return JSONResponse(model_card(model_id))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize: the ids the completions (``prompt``) or chat (``messages``)
        endpoint would queue, their count and max_model_len."""
        state.keys.authenticate(request.headers.getlist("authorization"))
        req = parse_body(TokenizeRequest, await state.read_json(request))
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            ids = await asyncio.to_thread(state.tokenizer.encode, req.prompt,
                                          req.add_special_tokens)
        else:
            tools = [tool.model_dump(exclude_none=True) for tool in req.tools or ()]
            ids = await asyncio.to_thread(chat_ids, state, req.messages,
                                          req.add_generation_prompt, None,
                                          req.continue_final_message, tools or None)
        # vLLM's token_strs, null unless asked (QA: return_token_strs was an unknown field)
        strs = [state.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs \
            else None
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len,
                             "tokens": ids, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize: token ids back to text (special tokens kept)."""
        state.keys.authenticate(request.headers.getlist("authorization"))
        req = parse_body(DetokenizeRequest, await state.read_json(request))
        state.check_model(req.model)
        check_token_ids(req.tokens, state.tokenizer.vocab_size, "'tokens'", "tokens")
        text = await asyncio.to_thread(state.tokenizer.decode, req.tokens, False)
        return JSONResponse({"prompt": text})

    @app.post("/v1/abort")
    async def abort(request: Request) -> Response:
        key = state.keys.authenticate(request.headers.getlist("authorization"))
        if not key.admin:
            raise APIError(403, "aborting requests needs an admin key")
        body = await state.read_json(request)
        ids = body.get("request_id") if isinstance(body, dict) else None
        extra = sorted(set(body) - {"request_id"}) if isinstance(body, dict) else []
        if extra:  # as every other endpoint refuses a field it does not know (QA: taken)
            raise bad_request(f"unknown field '{extra[0]}': this server does not know it; "
                              "remove it", param=extra[0])
        if isinstance(ids, str):
            ids = [ids]
        if not isinstance(ids, list) or not ids or not all(isinstance(i, str) for i in ids):
            raise bad_request("send {\"request_id\": ID} or {\"request_id\": [ID, ...]}",
                              param="request_id")
        aborted: list[str] = []
        not_found: list[str] = []  # no live request, or its abort was asked already
        for request_id in ids:
            (aborted if _abort(state, request_id) else not_found).append(request_id)
        return JSONResponse({"aborted": aborted, "not_found": not_found})

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str, request: Request) -> Response:
        """Release a session's held KV now (U8). With API keys, a tenant's key reaches only
        its own sessions (another tenant's is 404, as if absent); an admin key, or a server
        without keys, releases every tenant's session of that id."""
        key = state.keys.authenticate(request.headers.getlist("authorization"))
        tenant = None if key.admin else key.tenant
        check_session_id(session_id)
        try:
            await state.engine.release_session(session_id, tenant)
        except SessionNotFound:
            if state.scheduler_config.max_session_kv == 0:
                raise APIError(404, f"session {session_id!r} not found: sessions are off on "
                                    "this server (--max-session-kv)",
                               code="session_not_found") from None
            raise APIError(404, f"session {session_id!r} not found: it ended (its ttl ran "
                                "out, memory pressure released it, or it was deleted) or "
                                "never existed", code="session_not_found") from None
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})

    # /ping: vLLM's (SageMaker's) name for the same check, GET or POST
    @app.api_route("/ping", methods=["GET", "POST"])
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return health_response(state.engine)

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": __version__}

    @app.api_route("/metrics", methods=["GET", "HEAD"])  # HEAD: a probe's
    @app.api_route("/metrics/", methods=["GET", "HEAD"])  # vLLM's serves it (no 307)
    async def metrics() -> Response:
        return Response(state.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    admin.register(app, state)
    app.state.dashboard = dashboard.register(app, state)
    return app


def health_response(engine: ServingEngine) -> Response:
    """/health: "ok", or what is degraded (200: the server still serves); 503 when nothing
    serves, with Retry-After while every replica restarts (the chaos pass: a probe or load
    balancer was told nothing of when to come back)."""
    down = engine.health()
    if engine.is_running:
        return PlainTextResponse(down or "ok")
    return APIError(503, down or "the engine is not running", headers=None if down is None
                    else {"Retry-After": str(RETRY_WHILE_RESTARTING_S)}).response()


def _live_request(state: ServerState, name: str) -> tuple[Any, str | None]:
    """The live request ``name`` names, as (its group's stream, None for the whole group or
    the choice's id): the request's id, its response's ``cmpl-`` / ``chatcmpl-`` id, or a
    choice's ``<id>-<index>``; (None, None) if none."""
    for request_id in (name, _strip_prefix(name)):
        stream = state.groups.get(request_id)
        if stream is not None:
            return stream, None
        group, dash, _ = request_id.rpartition("-")
        stream = state.groups.get(group) if dash else None
        if stream is not None and request_id in stream.request_ids:
            return stream, request_id
    return None, None


def _abort(state: ServerState, name: str) -> bool:
    """Abort what ``name`` names (:func:`_live_request`'s names, live or still being taken
    by the engine, ServerState's ``queuing``); or, where requests run under suffixed engine
    ids (a tenant's, ``engine_id``), the id the client sent, or a choice of it as
    ``<id>-<index>`` (QA: not_found, and the choice ran to its end). False if nothing was
    left to abort."""
    stream, choice = _live_request(state, name)
    found = stream is not None and stream.abort(choice)
    found = _abort_queuing(state, name) or found
    sent = _strip_prefix(name)
    base, dash, index = sent.rpartition("-")
    names = [(sent, None), *([(base, index)] if dash and index.isdigit() else [])]
    for given, choice_of in names:
        engine_ids = list(state.given.get(given, ()))
        for engine_id in engine_ids:
            choice = None if choice_of is None else f"{engine_id}-{choice_of}"
            group, queuing = state.groups.get(engine_id), state.queuing.get(engine_id)
            if group is not None and (choice is None or choice in group.request_ids):
                found = group.abort(choice) or found
            if queuing is not None and (choice is None or choice in queuing.choice_ids):
                found = queuing.ask(choice) or found
        if engine_ids:  # the id as sent names requests: not a choice of another's, as
            break  # _live_request prefers it
    return found


def _abort_queuing(state: ServerState, name: str) -> bool:
    """Ask the abort of a request the engine has not answered the add of yet (ServerState's
    ``queuing``), named as :func:`_live_request` takes it; False if none or asked already."""
    for request_id in (name, _strip_prefix(name)):
        queuing = state.queuing.get(request_id)
        if queuing is not None:
            return queuing.ask(None)
        group, dash, _ = request_id.rpartition("-")
        queuing = state.queuing.get(group) if dash else None
        if queuing is not None and request_id in queuing.choice_ids:
            return queuing.ask(request_id)
    return False


def _strip_prefix(request_id: str) -> str:
    for prefix in ("chatcmpl-", "cmpl-"):
        if request_id.startswith(prefix):
            return request_id[len(prefix):]
    return request_id

