"""The benchmark's streaming client for plain-HTTP servers: one POST per request on its own
asyncio connection, its response read as server-sent events.

Why not httpx, which the benchmark uses for everything else: the client shares the machine with
the server it measures, and httpx's async streaming costs ~120 us of CPU per event (1.18 s of
client CPU in a 5 s run of docs/results-serving.md's serving workload on 2 cores, measured with getrusage),
CPU the server's threads then do not get. Reading the socket directly costs a fraction of that.
HTTPS URLs (and anything this module does not parse) stay on httpx (runtime/bench/driver.py).

HTTP/1.1 only: the status line, the headers, then a chunked, sized or read-until-close body.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit


class StreamError(Exception):
    """The response could not be read (closed early, malformed framing)."""


def plain_http(url: str) -> bool:
    """Whether `url` is one this client speaks to (http://host[:port], no path prefix needed)."""
    return urlsplit(url).scheme == "http"


class SSEStream:
    """`async with SSEStream(url, path, payload, headers, timeout_s) as s:` sends the POST;
    `s.status` is the HTTP status, `s.events()` yields each `data:` payload as text, and
    `await s.body()` reads a whole (error) body."""

    def __init__(
        self, url: str, path: str, payload: dict, headers: dict[str, str] | None, timeout_s: float
    ):
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.path = parts.path.rstrip("/") + path
        self.payload, self.headers, self.timeout_s = payload, headers or {}, timeout_s
        self.status = 0
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._chunked, self._left = False, -1  # -1: read until the connection closes
        self._last = 0.0  # loop time of the last read (the watchdog's clock)
        self._timed_out = False
        self._watch: asyncio.Task | None = None

    async def __aenter__(self) -> SSEStream:
        self._reader, self._writer = await asyncio.wait_for(
            asyncio.open_connection(self.host, self.port), self.timeout_s
        )
        self._last = asyncio.get_running_loop().time()
        self._watch = asyncio.create_task(self._watchdog())
        body = json.dumps(self.payload).encode()
        head = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Content-Type: application/json",
            "Accept: text/event-stream",
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        head += [f"{k}: {v}" for k, v in self.headers.items()]
        self._writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        await self._writer.drain()
        status_line = await self._line()
        try:
            self.status = int(status_line.split(b" ", 2)[1])
        except (IndexError, ValueError):
            raise StreamError(f"not an HTTP response: {status_line[:80]!r}") from None
        while (line := await self._line()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "transfer-encoding" and "chunked" in value:
                self._chunked = True
            elif name == "content-length":
                self._left = int(value)
        return self

    async def _watchdog(self) -> None:
        """Close the connection once no read has completed for timeout_s: the pending read then
        fails. One timer per stream instead of a wait_for around every read (a task each)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.timeout_s))
            if loop.time() - self._last > self.timeout_s:
                self._timed_out = True
                self._writer.close()
                return

    async def __aexit__(self, *exc) -> None:
        if self._watch is not None:
            self._watch.cancel()
        if self._writer is not None:
            self._writer.close()
            try:
                await self._writer.wait_closed()
            except (ConnectionError, OSError):
                pass

    def _read(self, data: bytes) -> bytes:
        self._last = asyncio.get_running_loop().time()
        return data

    def _closed(self) -> StreamError:
        if self._timed_out:
            return StreamError(f"no data for {self.timeout_s:g} s")
        return StreamError("the connection closed inside a response")

    async def _line(self) -> bytes:
        line = await self._reader.readline()
        if not line and self._timed_out:
            raise self._closed()
        return self._read(line)

    async def _exactly(self, n: int) -> bytes:
        try:
            return self._read(await self._reader.readexactly(n))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise self._closed() from None

    async def _pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives, framing removed."""
        if self._chunked:
            while True:
                size_line = await self._line()
                try:
                    size = int(size_line.split(b";")[0].strip(), 16)
                except ValueError:
                    raise StreamError(f"bad chunk size {size_line[:40]!r}") from None
                if size == 0:
                    return
                data = await self._exactly(size)
                await self._exactly(2)  # the CRLF after each chunk
                yield data
        elif self._left >= 0:
            if self._left:
                yield await self._exactly(self._left)
        else:
            while data := await self._reader.read(65536):
                yield self._read(data)
            if self._timed_out:
                raise self._closed()

    async def events(self) -> AsyncIterator[str]:
        """Each `data:` field of the event stream (stripped), in order."""
        pending = b""
        async for piece in self._pieces():
            pending += piece
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode()
        if pending.startswith(b"data:"):
            yield pending[5:].strip().decode()

    async def body(self) -> bytes:
        return b"".join([piece async for piece in self._pieces()])
