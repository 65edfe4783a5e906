"""HTTP glue of the server: bearer-token auth, OpenAI-style error handlers, a streaming response
that always closes its body generator and drops a client that stops reading, body size and time
limits, client-disconnect watching."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from slimserve.runtime.server.protocol import MAX_BODY_BYTES, APIError, error_body
from slimserve.runtime.server.trust import INTERNAL_KEY_HEADER, key_matches

log = logging.getLogger("slimserve.runtime.server.app")


class StalledClient(Exception):
    """The client read nothing for the stream timeout: the socket's buffers stayed full."""


class ClosingStreamingResponse(StreamingResponse):
    """Closes its body generator however the response ends. Starlette cancels the send loop on
    a disconnect while the generator may sit at a `yield`; closing runs its `finally` (the
    abort) now instead of whenever the garbage collector finalizes it.

    send_timeout: a send blocks once the client's TCP window and the server's buffers are full,
    i.e. when the client reads nothing; if one blocks this long, the response ends (the server
    then closes the connection) and the body generator's `finally` aborts the request.
    """

    def __init__(self, *args: Any, send_timeout: float | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.send_timeout = send_timeout

    async def stream_response(self, send: Any) -> None:
        timeout = self.send_timeout
        if timeout is None:
            return await super().stream_response(send)
        # One watch per response instead of a cancel scope around every send: a scope per
        # token cost more event-loop time than the token's own formatting, and the loop's
        # thread shares the GIL with the engine's. A send that is still blocked when the
        # watch next looks (every timeout / 4) past `timeout` ends the response.
        loop = asyncio.get_running_loop()
        sending_since: list[float | None] = [None]

        async def timed_send(message: Any) -> None:
            sending_since[0] = loop.time()
            await send(message)
            sending_since[0] = None

        stream = asyncio.ensure_future(super().stream_response(timed_send))
        try:
            while True:
                done, _ = await asyncio.wait({stream}, timeout=timeout / 4)
                if done:
                    return stream.result()
                since = sending_since[0]
                if since is not None and loop.time() - since >= timeout:
                    raise StalledClient(f"the client read nothing for {timeout:g} s")
        finally:
            if not stream.done():
                stream.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait({stream})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except StalledClient as e:
            log.warning("stream dropped: %s", e)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]


def bearer_matches(request: Request, key: str) -> bool:
    """Whether `request` carries `Authorization: Bearer <key>` (constant-time compare)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and key_matches(key, token)


def bearer_auth(api_key: str | None):
    """A dependency that checks `Authorization: Bearer <key>` (constant-time compare)."""

    async def check(request: Request) -> None:
        if api_key is not None and not bearer_matches(request, api_key):
            raise APIError(
                401,
                "missing or incorrect API key; send 'Authorization: Bearer <key>'",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def check_internal_key(request: Request, internal_key: str | None, what: str) -> None:
    """APIError unless `request` carries this deployment's internal key (runtime/server/trust.py):
    403 when the server has none (`what` is refused outright), 401 when it is missing or wrong."""
    if internal_key is None:
        raise APIError(
            403,
            f"{what} is internal and this server has no internal key; start it "
            "with --internal-key (or SLIMSERVE_INTERNAL_KEY) and send the key as "
            "X-Slimserve-Internal-Key",
            code="internal_key_required",
        )
    if not key_matches(internal_key, request.headers.get(INTERNAL_KEY_HEADER)):
        raise APIError(
            401,
            f"{what} is internal: missing or incorrect X-Slimserve-Internal-Key",
            code="invalid_internal_key",
        )


def internal_auth(internal_key: str | None, what: str):
    """A dependency: `check_internal_key` for every request of a route."""

    async def check(request: Request) -> None:
        check_internal_key(request, internal_key, what)

    return check


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(
            error_body(str(exc.detail), param=None, code=code),
            exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    async def internal(request: Request, exc: Exception) -> Response:
        log.error("unhandled error on %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body("internal server error", "server_error"), 500)

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, internal)


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is already read, so only disconnect remains)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, aw: Awaitable[Any]) -> Any:
    """Await `aw`, cancelling it and raising ClientGone if the client disconnects first."""
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # client gone, or we were cancelled (server shutdown)
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def read_body(request: Request, timeout: float) -> bytes:
    """The request body, refused with 413 past MAX_BODY_BYTES and 408 when it has not all
    arrived within `timeout` s (a client trickling bytes holds a connection, nothing more)."""
    chunks, size = [], 0
    with anyio.move_on_after(timeout) as scope:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise APIError(413, f"request body exceeds {MAX_BODY_BYTES // 2**20} MiB")
            chunks.append(chunk)
    if scope.cancelled_caught:
        raise APIError(
            408,
            f"request body not received within {timeout:g} s; send it at once",
            code="body_timeout",
        )
    return b"".join(chunks)
