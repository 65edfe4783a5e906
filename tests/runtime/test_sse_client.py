"""The benchmark's light SSE client (runtime/bench/sse_client.py) against raw sockets: chunked,
sized and read-until-close bodies, events split across reads, the inactivity timeout, and a
reply that is not HTTP. The real server path is covered by tests/runtime/test_serving_bench.py
(its fake server streams chunked events to this client)."""

import asyncio

import pytest

from slimserve.runtime.bench.sse_client import SSEStream, StreamError, plain_http


def _serve(reply_parts, delay_s=0.0, hold=False):
    """An asyncio server answering each connection with reply_parts (bytes, sent one by one)."""
    seen = []

    async def handle(reader, writer):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                h.split(b":")[1]
                for h in head.split(b"\r\n")
                if h.lower().startswith(b"content-length")
            )
        )
        seen.append((head, await reader.readexactly(length)))
        for part in reply_parts:
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(delay_s)
        if hold:
            await asyncio.sleep(30)
        writer.close()

    return handle, seen


async def _collect(reply_parts, timeout_s=5.0, delay_s=0.0, hold=False):
    handle, seen = _serve(reply_parts, delay_s, hold)
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with SSEStream(
            f"http://127.0.0.1:{port}",
            "/v1/completions",
            {"a": 1},
            {"Authorization": "Bearer k"},
            timeout_s,
        ) as s:
            if s.status != 200:
                return s.status, (await s.body()).decode(), seen
            return s.status, [e async for e in s.events()], seen
    finally:
        server.close()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def test_chunked_events_split_across_chunks():
    pieces = [b"data: x", b'\n\ndata: {"', b'k": 1}\n\ndata:', b" [DONE]\n\n"]
    body = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n",
        *map(_chunk, pieces),
        b"0\r\n\r\n",
    ]
    status, events, seen = asyncio.run(_collect(body, delay_s=0.01))
    assert status == 200 and events == ["x", '{"k": 1}', "[DONE]"]
    head, payload = seen[0]
    assert head.startswith(b"POST /v1/completions HTTP/1.1") and b"Authorization: Bearer k" in head
    assert payload == b'{"a": 1}'


def test_sized_error_body_and_read_until_close():
    err = b'{"error": {"message": "too long"}}'
    status, body, _ = asyncio.run(
        _collect([b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(err), err])
    )
    assert status == 400 and body == err.decode()
    status, events, _ = asyncio.run(_collect([b"HTTP/1.1 200 OK\r\n\r\ndata: a\n\n", b"data: b"]))
    assert status == 200 and events == ["a", "b"]


def test_a_silent_server_times_out_and_a_cut_stream_is_an_error():
    with pytest.raises(StreamError, match="no data for 0.3 s"):
        asyncio.run(
            _collect(
                [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\ndata:\r\n"],
                timeout_s=0.3,
                hold=True,
            )
        )
    with pytest.raises(StreamError, match="closed inside"):
        asyncio.run(
            _collect([b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n20\r\ndata: x"])
        )


def test_not_http_is_refused():
    with pytest.raises(StreamError, match="not an HTTP response"):
        asyncio.run(_collect([b"SSH-2.0-OpenSSH\r\n\r\n"]))
    assert plain_http("http://127.0.0.1:8000") and not plain_http("https://example.com")
