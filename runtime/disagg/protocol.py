"""How a router and the servers ask for a hand-over over HTTP (runtime/router/app.py sends these,
runtime/server/app.py honours them), on the usual /v1/completions and /v1/chat/completions:

- `X-Slimserve-KV-Prefill: 1` asks a server to prefill only: it validates the request as always
  (its 400s are the client's answer), computes the prompt's KV and first token for each choice,
  writes each into a segment and answers 200 `{"kv_segments": [name, ...], "prompt_tokens": N}`;
- `X-Slimserve-KV: <name>[,<name>...]` (one per choice) asks a server to continue from those
  segments: same request body, and the answer is the ordinary one (streamed or not).

A replica's role (`runtime serve --role`) is advertised in its GET /state as "role"; only a
`prefill` server prefills only, only a `decode` one continues (400 `wrong_role` otherwise), and
the router never forwards these headers from its clients, so a client cannot make a server
write or read shared memory through it.
"""

from __future__ import annotations

from slimserve.runtime.disagg.errors import KVHandleError
from slimserve.runtime.disagg.segment import check_name

PREFILL_HEADER = "x-slimserve-kv-prefill"
KV_HEADER = "x-slimserve-kv"
ROLES = ("colocated", "prefill", "decode")
MAX_SEGMENTS = 128  # names one header may carry (n is capped far lower by the server)


def parse_kv_header(value: str, n: int) -> list[str]:
    """The segment names of an X-Slimserve-KV header, one per choice."""
    names = [v.strip() for v in value.split(",") if v.strip()][: MAX_SEGMENTS + 1]
    if len(names) != n:
        raise KVHandleError(
            f"{KV_HEADER}: {len(names)} segment(s) for n={n} choices; send one "
            "per choice, as the prefill replica returned them"
        )
    return [check_name(name) for name in names]
