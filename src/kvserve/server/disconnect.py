"""Noticing that a client went away: for a response still being prepared (race the work
against ``http.disconnect``) and for a streamed one (close the engine's stream however the
response ends)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

_T = TypeVar("_T")


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def race_disconnect(request: Request, work: Awaitable[_T]) -> _T:
    """``await work``, unless the client disconnects first: then cancel it, raise ClientGone.
    The body must already have been read."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_until_disconnected(request.receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task},
                                     return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch_task.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    raise ClientGone


async def tell_if_gone(request: Request, work: Awaitable[_T], gone: Callable[[], None]) -> _T:
    """``await work`` to its end, calling ``gone`` at once should the client disconnect
    meanwhile (the work is not cancelled: an engine's add is answered whatever happens)."""
    def told(watch: asyncio.Future[None]) -> None:
        if not watch.cancelled() and watch.exception() is None:
            gone()
    watch_task = asyncio.ensure_future(_until_disconnected(request.receive))
    watch_task.add_done_callback(told)
    try:
        return await work
    finally:
        watch_task.cancel()


async def _until_disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs ``on_close`` however it ends (done, disconnect,
    cancellation), so the engine never keeps generating for nobody."""

    def __init__(self, content: AsyncIterator[str], on_close: Any, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
