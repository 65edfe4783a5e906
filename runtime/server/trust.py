"""The internal credential: what separates a deployment's own traffic from its clients'.

Clients hold at most the API key (`--api-key`, `Authorization: Bearer`). The internal key
(`--internal-key`, or SLIMSERVE_INTERNAL_KEY so that `ps` does not show it) is held only by the
parts of one deployment: the router and the replicas it talks to. It is sent as
`X-Slimserve-Internal-Key` and required, whatever port a request arrives on, by

- the KV hand-over: the `X-Slimserve-KV-Prefill` / `X-Slimserve-KV` headers and GET / POST
  /kv_segments (runtime/disagg/protocol.py): with them a caller writes K/V into a server's cache;
- the admin endpoints: POST /reset_prefix_cache, /start_profile, /stop_profile.

A server started without one refuses all of these (403 naming the flag). `runtime serve
--data-parallel-size N` and `runtime bench` / `runtime tune` (which start their own servers)
make a fresh key per deployment when none is given and hand it to the processes they start
through the environment, never the command line. This module has no web framework in it, so a
client (runtime/bench/) can import it cheaply.
"""

from __future__ import annotations

import hmac
import secrets

INTERNAL_KEY_HEADER = "x-slimserve-internal-key"
INTERNAL_KEY_ENV = "SLIMSERVE_INTERNAL_KEY"


def new_internal_key() -> str:
    """A fresh per-deployment key (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def key_matches(expected: str, given: str | None) -> bool:
    """Constant-time comparison; no key given never matches."""
    return given is not None and hmac.compare_digest(given.strip().encode(), expected.encode())


def internal_headers(key: str | None) -> dict[str, str]:
    """The header that carries `key` ({} without one)."""
    return {INTERNAL_KEY_HEADER: key} if key else {}
