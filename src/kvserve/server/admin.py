"""The operator's endpoints beyond /v1/abort: recording switched at run time
(docs/recording.md). Each needs an admin key when keys are configured."""

from __future__ import annotations

import asyncio
import os
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.server.body import parse_json
from kvserve.server.errors import APIError, bad_request
from kvserve.server.state import ServerState


def require_admin(state: ServerState, request: Request, what: str) -> Any:
    """The admin key of ``request``, or a 401/403. Without keys, a 403 for a browser's
    request from another site's page (its Origin is not this server's Host): any page the
    operator opened could start a recording into any directory the server may write (the
    dashboard pass; a text/plain POST needs no CORS preflight). curl and the CLI send no
    Origin; with keys, the admin key is what a foreign page cannot send (the review: a
    proxy that rewrites Host, or localhost against 127.0.0.1, was refused a valid key)."""
    origin = request.headers.get("origin")
    if origin is not None and not state.keys.enabled and \
            urlsplit(origin).netloc != request.headers.get("host"):
        raise APIError(403, f"{what} is refused from another site's page (Origin {origin[:80]})")
    key = state.keys.authenticate(request.headers.getlist("authorization"))
    if not key.admin:
        raise APIError(403, f"{what} needs an admin key")
    return key


def check_tenant_directory(directory: str) -> None:
    """A keys file's admin (a tenant's key, not the operator's) records only under the
    server's working directory, as docs/cli.md says (QA: any path the server could write,
    and its errors told which paths exist); a 400 otherwise."""
    if "\0" in directory:
        return  # the recorder's own check names it
    here = os.path.realpath(os.getcwd())
    where = os.path.realpath(os.path.join(here, directory))
    if os.path.isabs(directory) or where == here or os.path.commonpath([here, where]) != here:
        raise bad_request("'dir' must be a directory under the server's working directory, "
                          "named relative to it (an operator's key may name any)",
                          param="dir")


def new_recorder(state: ServerState, directory: str) -> Any:
    """A recorder into ``directory`` for this server's engines, observing them (inactive
    until started). Raises RecordingError naming the problem."""
    from kvserve.server.recorder import Recorder

    recorder = Recorder(directory, state.engine.info, prompts=state.record_prompts,
                        max_file_bytes=state.record_max_file_bytes,
                        model_name=state.model_name, model_id=state.model_id,
                        num_engines=getattr(state.engine, "num_replicas", 1),
                        router=getattr(state.engine, "router", None))
    old = state.recorder
    if old is not None:
        old.close()
        old.detach(state.engine)
    recorder.attach(state.engine)
    state.recorder = recorder
    return recorder


def in_flight(state: ServerState) -> int:
    """Requests under way, at least as many as the engines hold: their last step's counts
    miss what arrived since, so the HTTP requests being answered count too (QA: started
    during a 2.7 s step, a recording said 0 in flight with 9 queued, and claimed an exact
    replay)."""
    stats = state.engine.stats
    return max(stats.num_running + stats.num_waiting + stats.num_swapped, len(state.groups))


def cache_queries(state: ServerState) -> int:
    """The engines' prefix cache lookups so far (tokens): whether the cache was touched."""
    return state.engine.stats.prefix_cache_queries


def register(app: FastAPI, state: ServerState) -> None:
    # One start or stop at a time; their file work (a recorder's directory and manifest, the
    # old one's last lines, a flush) runs on a worker thread, so a slow disk delays the
    # admin answer, not the other requests (the dashboard pass: serving froze for 10 s)
    switching = asyncio.Lock()

    @app.get("/admin/record")
    async def record_status(request: Request) -> Response:
        require_admin(state, request, "the recording's status")
        if state.recorder is None:
            return JSONResponse({"recording": False, "directory": None})
        return JSONResponse(state.recorder.status())

    @app.post("/admin/record/start")
    async def record_start(request: Request) -> Response:
        key = require_admin(state, request, "starting a recording")
        raw = await state.read_body(request)
        async with switching:
            return await _start(key, raw)

    async def _start(key: Any, raw: bytes) -> Response:
        from kvserve.server.recorder import RecordingError, check_nul

        body = parse_json(raw) if raw.strip() else {}  # no body (or an empty one): {}
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object, e.g. {\"dir\": PATH}")
        unknown = sorted(set(body) - {"dir"})
        if unknown:
            raise bad_request(f"unknown field {unknown[0]!r}: this endpoint takes 'dir' only",
                              param=unknown[0])
        directory = body.get("dir")
        if directory is not None and (not isinstance(directory, str) or not directory):
            raise bad_request("'dir' must be a directory path", param="dir")
        try:
            if directory is not None:
                check_nul(directory)  # before realpath below reads it (QA: a 500)
        except RecordingError as error:
            raise bad_request(str(error), param="dir") from None
        recorder = state.recorder
        if directory is not None and recorder is not None and \
                os.path.realpath(directory) == os.path.realpath(recorder.directory):
            directory = None  # the current recording's directory: a new segment there
        if directory is not None and state.keys.enabled and not key.operator:
            check_tenant_directory(directory)
        if directory is not None:
            if recorder is not None and recorder.active and recorder.error is None:
                raise APIError(409, f"already recording into {recorder.directory}; stop it "
                                    "first", param="dir", code="recording_active")
            try:
                recorder = await asyncio.to_thread(new_recorder, state, directory)
            except RecordingError as error:
                raise bad_request(str(error), param="dir") from None
        if recorder is None:
            raise bad_request("no recording directory: send {\"dir\": PATH} (or serve with "
                              "--record DIR)", param="dir")
        try:
            started = recorder.start(in_flight(state), cache_queries(state))
        except RecordingError as error:  # it stopped on an error
            raise bad_request(str(error), param="dir") from None
        return JSONResponse({**recorder.status(), "changed": started})

    @app.post("/admin/record/stop")
    async def record_stop(request: Request) -> Response:
        require_admin(state, request, "stopping a recording")
        async with switching:
            recorder = state.recorder
            if recorder is None:
                return JSONResponse({"recording": False, "directory": None, "changed": False})
            stopped = recorder.stop(cache_queries(state))
            await asyncio.to_thread(recorder.flush)
            return JSONResponse({**recorder.status(), "changed": stopped})
