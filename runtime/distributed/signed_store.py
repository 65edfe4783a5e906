"""Messages through the group's TCPStore, signed with a per-run secret.

The store has no authentication of its own, and under the `ray` executor it listens on the
node's address (runtime/worker/ray_executor.py), where another host of that network can
reach it. Everything our ranks say through it (the step headers and the workers' messages of
`StoreChannel`, the published rank stats of runtime/stats/rank_stats.py) goes through
`SignedStore`: each value is stored as HMAC-SHA256(secret, key || 0 || value) followed by the
value, and a read whose tag does not match raises `ForgedMessage`. The key is inside the tag,
so a value copied to another key (a replayed step header) fails too. The secret is drawn by
the driver for each run (`new_secret`) and handed to the ranks it starts with their start
arguments (spawn's pipe, or Ray's actor call), never through the store. torch's own rendezvous
keys (gloo's) stay unsigned: keep the Ray nodes' network private.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

TAG_BYTES = 32


class ForgedMessage(RuntimeError):
    """A store value whose signature does not match: written by something without the secret."""


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def _tag(secret: bytes, key: str, value: bytes) -> bytes:
    return hmac.new(secret, key.encode() + b"\0" + value, hashlib.sha256).digest()


def seal(secret: bytes, key: str, value: bytes | str) -> bytes:
    """The stored form of `value` under `key`: its tag, then the value."""
    data = value.encode() if isinstance(value, str) else bytes(value)
    return _tag(secret, key, data) + data


def unseal(secret: bytes, key: str, blob: bytes) -> bytes:
    """The value `seal` stored under `key`; ForgedMessage when the tag does not match."""
    tag, data = blob[:TAG_BYTES], blob[TAG_BYTES:]
    if len(tag) < TAG_BYTES or not hmac.compare_digest(tag, _tag(secret, key, data)):
        raise ForgedMessage(
            f"tensor-parallel store: the value under {key!r} is not signed with "
            "this run's secret (written by another process on the network?)"
        )
    return data


class SignedStore:
    """A TCPStore view whose `set` signs and whose `get` checks; `check`, `wait`, `delete_key`
    and `port` are the store's own."""

    def __init__(self, store, secret: bytes):
        self.store, self.secret = store, secret

    def set(self, key: str, value: bytes | str) -> None:
        self.store.set(key, seal(self.secret, key, value))

    def get(self, key: str) -> bytes:
        return unseal(self.secret, key, self.store.get(key))

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)

    def wait(self, keys: list[str], *timeout) -> None:
        self.store.wait(keys, *timeout)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)

    @property
    def port(self) -> int:
        return self.store.port
