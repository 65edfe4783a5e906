"""Moving KV segments between hosts through the router: GET /kv_segments/{name} from the
prefill replica streamed into POST /kv_segments on the decode replica (runtime/disagg/segment.py
serves both ends), which answers the name the segment has there. Its bytes pass through once,
never buffered whole. The router calls it when the two replicas do not share /dev/shm
(runtime/router/app.py, `_handover`)."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from slimserve.runtime.server.protocol import APIError, error_message


async def relay_segments(
    client: httpx.AsyncClient,
    source_url: str,
    target_url: str,
    names: list[str],
    auth: dict[str, str],
    moved: Callable[[int], None] = lambda n: None,
) -> list[str]:
    """The segments' names on `target_url` after moving each one from `source_url`; `auth`: the
    headers carrying the internal key both replicas require; `moved` gets the bytes of each. A
    failure is a 502 (`kv_relay_failed`) naming the replica and step."""
    out = []
    for name in names:
        step = f"fetching KV segment {name} from prefill replica {source_url}"
        try:
            async with client.stream(
                "GET", f"{source_url}/kv_segments/{name}", headers=auth
            ) as got:
                if got.status_code != 200:
                    await got.aread()
                    raise APIError(
                        502,
                        f"{step}: it answered {got.status_code}: {error_message(got.content)}",
                        code="kv_relay_failed",
                    )
                step = f"sending KV segment {name} to decode replica {target_url}"
                put = await client.post(
                    f"{target_url}/kv_segments",
                    content=got.aiter_raw(),
                    headers={**auth, "content-type": "application/octet-stream"},
                )
                moved(got.num_bytes_downloaded)
            if put.status_code != 201:
                raise APIError(
                    502,
                    f"{step}: it answered {put.status_code}: {error_message(put.content)}",
                    code="kv_relay_failed",
                )
            out.append(put.json()["kv_segment"])
        except httpx.HTTPError as e:
            raise APIError(
                502, f"{step} failed: {type(e).__name__}: {e}", code="kv_relay_failed"
            ) from None
        except (ValueError, KeyError, TypeError):
            raise APIError(
                502,
                f"{step}: the answer holds no segment name; is it a slimserve "
                "server of this version?",
                code="kv_relay_failed",
            ) from None
    return out
