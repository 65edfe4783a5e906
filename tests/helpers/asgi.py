"""Call an ASGI app directly, as a client the test controls byte by byte: a body that never
arrives, a reader that stops reading after some chunks, many requests in one burst."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field


@dataclass
class Reply:
    status: int | None = None
    chunks: list[bytes] = field(default_factory=list)  # body messages the app's sends delivered
    complete: bool = False  # the app sent its last body message (more_body False)

    @property
    def text(self) -> str:
        return b"".join(self.chunks).decode()

    def json(self):
        return json.loads(self.text)


async def call(
    app,
    path: str,
    body: dict | None,
    *,
    method: str = "POST",
    send_body: bool = True,
    read_chunks: int | None = None,
) -> Reply:
    """One request. send_body=False: the body never arrives (the client sends headers only).
    read_chunks=k: the client takes k body messages, then never reads again (each later send
    blocks forever, as when its TCP window is full)."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(raw)).encode()),
        ],
    }
    forever = asyncio.Event()
    reply, got = Reply(), []

    async def receive():
        if send_body and not got:
            got.append(1)
            return {"type": "http.request", "body": raw, "more_body": False}
        await forever.wait()  # no disconnect either: the client just sits there
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            reply.status = message["status"]
        elif message["type"] == "http.response.body":
            if read_chunks is not None and message.get("body") and len(reply.chunks) >= read_chunks:
                await forever.wait()
            if message.get("body"):
                reply.chunks.append(message["body"])
            if not message.get("more_body", False):
                reply.complete = True

    await app(scope, receive, send)
    return reply
