"""The router's replicas: registry, health and load polling, and the local bookkeeping of each
dispatch (runtime/router/policy.py reads it).

Every POLL_INTERVAL_S the router GETs each replica's /state (runtime/server/app.py): 200 updates
its load and keeps it up, 503 (unhealthy engine) or a connection error takes it out at once,
DOWN_AFTER_TIMEOUTS timeouts in a row too. A server without /state (404) is polled on /health
and routed on the router's own counters only. A replica that answers again comes back.

Taking a replica out fails its in-flight requests promptly: each read the proxy does on it runs
inside a cancel scope registered with the replica (`guard`), which `mark_down` cancels.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx

from slimserve.runtime.disagg.protocol import ROLES
from slimserve.runtime.router.policy import PromptInfo, ReplicaState, new_tokens
from slimserve.runtime.server.protocol import error_message
from slimserve.runtime.stats.step_cost import StepCost

log = logging.getLogger(__name__)
POLL_INTERVAL_S = 0.15
POLL_TIMEOUT_S = 1.0
DOWN_AFTER_TIMEOUTS = 3  # polls timing out in a row before a replica is taken out


class ReplicaFailed(Exception):
    """The replica serving a request was taken out of rotation while the request ran."""


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or len(url.split("//", 1)[1]) == 0:
        raise ValueError(f"replica URL {url!r}: expected http://host:port")
    return url


class Ticket:
    """One request dispatched to a replica: keeps the replica's local counters right."""

    def __init__(self, replica: Replica, prefill_tokens: int) -> None:
        self.replica = replica
        self.epoch = replica.epoch
        self.prefill_tokens = prefill_tokens
        self.prefilling = True
        self.open = True
        self.sent_at = time.monotonic()
        s = replica.state
        s.inflight += 1
        s.inflight_prefilling += 1
        s.inflight_prefill_tokens += prefill_tokens
        s.prefill_sent_since_poll += prefill_tokens
        s.prefills_sent_since_poll += 1
        s.dispatched += 1
        replica.prefilling.add(self)

    def first_token(self) -> None:
        if self.prefilling:
            self.prefilling = False
            s = self.replica.state
            s.inflight_prefilling -= 1
            s.inflight_prefill_tokens -= self.prefill_tokens
            self.replica.prefilling.discard(self)
            if self.sent_at > self.replica.poll_sent_at:
                s.prefill_sent_since_poll -= self.prefill_tokens
                s.prefills_sent_since_poll -= 1

    def done(self) -> None:
        if self.open:
            self.first_token()
            self.open = False
            self.replica.state.inflight -= 1


class Replica:
    def __init__(self, url: str) -> None:
        self.url = normalize_url(url)
        self.state = ReplicaState(self.url, up=False)  # up once a poll has answered
        self.has_state = True  # serves GET /state; False: an older server, /health only
        self.epoch = 0  # bumped whenever it is taken out: requests of an older epoch failed
        self.problem: str | None = "not polled yet"
        self.timeouts = 0
        self.last_poll: float | None = None  # monotonic s of the last answered poll
        self.poll_sent_at = float("-inf")  # monotonic s the last applied /state poll was sent
        self.prefilling: set[Ticket] = set()  # dispatched here, no first token yet
        self._scopes: set[anyio.CancelScope] = set()

    @property
    def up(self) -> bool:
        return self.state.up

    def dispatch(self, prompt: PromptInfo) -> Ticket:
        """Count a request sent here and remember its prefix."""
        ticket = Ticket(self, new_tokens(self.state, prompt))
        self.state.prefixes.insert(prompt.prefix_hashes)
        return ticket

    def mark_down(self, reason: str) -> None:
        self.problem = reason
        if self.state.up:
            log.warning("replica %s taken out of rotation: %s", self.url, reason)
        self.state.up = False
        self.epoch += 1
        for scope in list(self._scopes):
            scope.cancel()

    def mark_up(self) -> None:
        if not self.state.up:
            log.info("replica %s is serving", self.url)
        self.state.up, self.problem, self.timeouts = True, None, 0

    @contextmanager
    def guard(self, ticket: Ticket) -> Iterator[None]:
        """Run a read of `ticket`'s request; ReplicaFailed if the replica is (or gets) taken out."""
        if ticket.epoch != self.epoch:
            raise ReplicaFailed(self.problem or "replica failed")
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                yield
            finally:
                self._scopes.discard(scope)
        if scope.cancelled_caught:
            raise ReplicaFailed(self.problem or "replica failed")

    def apply_state(self, body: dict[str, Any]) -> None:
        s = self.state

        def num(key: str, default: Any) -> Any:
            v = body.get(key)
            return v if isinstance(v, (int, float)) and not isinstance(v, bool) else default

        s.queued_prefill_tokens = int(num("queued_prefill_tokens", 0))
        s.num_running = int(num("num_running", 0))
        s.num_decoding = int(num("num_decoding", 0))
        s.decoding_context_tokens = int(num("decoding_context_tokens", 0))
        s.kv_cache_usage = float(num("kv_cache_usage", 0.0))
        s.step_cost = StepCost.from_dict(body.get("step_cost"))
        s.step_time_s = num("step_time_s", None)
        s.prefill_s_per_token = num("prefill_s_per_token", None)
        cpt = num("chars_per_token", None)
        s.chars_per_token = float(cpt) if cpt is not None and cpt > 0 else None
        s.max_num_batched_tokens = int(num("max_num_batched_tokens", s.max_num_batched_tokens))
        s.kv_host = body.get("kv_host") if isinstance(body.get("kv_host"), str) else None
        role = body.get("role")
        s.role = role if role in ROLES else "colocated"  # an older server: colocated

    def state_polled(self, body: dict[str, Any], sent_at: float) -> None:
        """Apply a /state answer to a poll sent at monotonic `sent_at`: the replica's load as it
        reported it, plus what this router sent it after the poll left (module doc, policy.py)."""
        self.apply_state(body)
        s = self.state
        s.polled = True
        s.answered_at = time.monotonic()
        self.poll_sent_at = sent_at
        since = [t for t in self.prefilling if t.sent_at > sent_at]
        s.prefill_sent_since_poll = sum(t.prefill_tokens for t in since)
        s.prefills_sent_since_poll = len(since)

    async def poll(self, client: httpx.AsyncClient) -> None:
        sent_at = time.monotonic()
        try:
            r = await client.get(
                self.url + ("/state" if self.has_state else "/health"), timeout=POLL_TIMEOUT_S
            )
            if r.status_code == 404 and self.has_state:
                self.has_state = False
                r = await client.get(self.url + "/health", timeout=POLL_TIMEOUT_S)
        except httpx.TimeoutException:
            self.timeouts += 1
            if self.timeouts >= DOWN_AFTER_TIMEOUTS:
                self.mark_down(f"{self.timeouts} health polls timed out")
            return
        except httpx.HTTPError as e:
            self.mark_down(f"unreachable: {type(e).__name__}: {e}")
            return
        self.timeouts = 0
        self.last_poll = time.monotonic()
        if r.status_code != 200:
            self.mark_down(
                f"{'/state' if self.has_state else '/health'} answered "
                f"{r.status_code}: {error_message(r.content)}"
            )
            return
        if self.has_state:
            try:
                self.state_polled(r.json(), sent_at)
            except ValueError:
                self.mark_down("/state answered something other than JSON")
                return
        self.mark_up()

    def describe(self) -> dict[str, Any]:
        s = self.state
        return {
            "url": self.url,
            "role": s.role,
            "kv_host": s.kv_host,
            "up": s.up,
            "problem": self.problem,
            "queued_prefill_tokens": s.queued_prefill_tokens,
            "num_running": s.num_running,
            "num_decoding": s.num_decoding,
            "decoding_context_tokens": s.decoding_context_tokens,
            "kv_cache_usage": s.kv_cache_usage,
            "step_cost": None if s.step_cost is None else s.step_cost.as_dict(),
            "step_time_s": s.step_time_s,
            "prefill_s_per_token": s.prefill_s_per_token,
            "chars_per_token": s.chars_per_token,
            "inflight": s.inflight,
            "dispatched": s.dispatched,
            "prefixes_remembered": len(s.prefixes),
        }


class ReplicaSet:
    """The replicas in registration order; added and removed at run time."""

    def __init__(self, urls: list[str]) -> None:
        self._replicas: dict[str, Replica] = {}
        for url in urls:
            self.add(url)

    def __iter__(self) -> Iterator[Replica]:
        return iter(list(self._replicas.values()))

    def __len__(self) -> int:
        return len(self._replicas)

    def get(self, url: str) -> Replica | None:
        return self._replicas.get(normalize_url(url))

    def add(self, url: str) -> Replica:
        url = normalize_url(url)
        if url not in self._replicas:
            self._replicas[url] = Replica(url)
        return self._replicas[url]

    def remove(self, url: str) -> Replica | None:
        """Out of rotation for good; requests running on it finish there."""
        return self._replicas.pop(normalize_url(url), None)

    def states(self) -> list[ReplicaState]:
        return [r.state for r in self._replicas.values()]

    def by_state(self, state: ReplicaState) -> Replica:
        return self._replicas[state.url]

    async def poll_all(self, client: httpx.AsyncClient) -> None:
        replicas = list(self._replicas.values())
        if replicas:
            await asyncio.gather(*(r.poll(client) for r in replicas))

    async def poll_forever(self, client: httpx.AsyncClient, interval_s: float) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.poll_all(client)
            except Exception:  # a bug here must not stop health checking
                log.exception("replica poll failed")
            await asyncio.sleep(max(0.0, interval_s - (time.monotonic() - started)))
