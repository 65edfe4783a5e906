"""The router: one OpenAI-compatible endpoint in front of several `runtime serve` replicas.

Each POST /v1/completions or /v1/chat/completions goes to one replica chosen by the policy
(runtime/router/policy.py) and is proxied as it is: the replica validates it and answers, and
its answer (status, body) comes back unchanged. Streams are forwarded event by event as they
arrive (only a partial SSE event is held back, so an error can never be spliced into one).

Failures, so that no client hangs:
- a replica that refuses the connection (or answers 503: queue full, engine dead, shutting
  down) has not started the request: the router tries the next one the policy picks, and takes
  a refusing replica out of rotation;
- a replica that fails while serving (connection lost, or the health poll takes it out:
  runtime/router/replicas.py) ends the request at once: 502 with an OpenAI-style body before the
  answer started, an in-band error event then `data: [DONE]` in a stream that already started;
- a client that disconnects closes the upstream request, and the replica aborts it.

Prefill/decode disaggregation (runtime/disagg/): while at least one `prefill` and one `decode`
replica are up (roles from their /state), a request goes first to a prefill replica chosen by
the policy, with `X-Slimserve-KV-Prefill: 1`: it answers with the shared-memory segments holding
the prompt's KV (or its own error, relayed as is); then the same body goes to a decode replica
(`Policy.choose_decode`) with `X-Slimserve-KV: segments`, and its answer is relayed like any
other (streams unbuffered). Refusals before starting move on to the next replica of the same
role; failures give the same 502 / in-band error. Without both roles up, every replica up
serves whole requests (any server can). When the two replicas do not share shared memory
(their /state `kv_host` differs: other hosts, or containers with their own /dev/shm), the
router moves each segment itself before the decode request: GET /kv_segments/{name} from the
prefill replica streamed into POST /kv_segments on the decode replica, which answers the name
to send in `X-Slimserve-KV` (its bytes pass through the router once, never buffered whole).
The hand-over needs the deployment's internal key (`internal_key`, runtime/server/trust.py):
the router sends it on the hand-over requests and segment moves, which the replicas refuse
without it; a router without one never hands over (every replica serves whole requests).

GET /v1/models is answered by a replica that is up; /health is 200 while at least one is;
/metrics is the router's own (Prometheus, `slimserve_router:` prefix); POST /reset_prefix_cache
(an admin call: the internal key, as on a replica) goes to every replica with the router's
internal key (and clears the prefix affinity's memory). GET /router/replicas
lists the replicas with their load; POST /router/replicas {"url": ...} adds one and DELETE
/router/replicas?url=... removes one (its running requests finish there), both only with the
router's admin key (`--admin-key`): without it the replica list cannot change at run time, so
nobody can point the router, and the Authorization headers it forwards, at a server of theirs.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from slimserve.runtime.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_STREAM_TIMEOUT_S
from slimserve.runtime.disagg.protocol import KV_HEADER, PREFILL_HEADER
from slimserve.runtime.router.policy import (
    Policy,
    PrefixIndex,
    PromptInfo,
    make_policy,
    predicted_ttft,
    prompt_info,
)
from slimserve.runtime.router.relay import relay_segments
from slimserve.runtime.router.replicas import (
    POLL_INTERVAL_S,
    Replica,
    ReplicaFailed,
    ReplicaSet,
    Ticket,
)
from slimserve.runtime.server.http import (
    ClientGone,
    ClosingStreamingResponse,
    bearer_auth,
    bearer_matches,
    install_error_handlers,
    internal_auth,
    read_body,
    unless_disconnected,
)
from slimserve.runtime.server.protocol import APIError, error_body
from slimserve.runtime.server.trust import internal_headers

log = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 5.0
CLIENT_CLOSED = 499
RETRYABLE_503 = {"queue_full", "engine_dead", "shutting_down"}  # the replica did not start it
FORWARDED_HEADERS = ("authorization", "content-type", "accept")
P = "slimserve_router:"


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()


DONE = b"data: [DONE]\n\n"


class _ReplicaCollector(Collector):
    def __init__(self, replicas: ReplicaSet) -> None:
        self.replicas = replicas

    def collect(self):
        up = GaugeMetricFamily(
            P + "replica_up", "1 while the replica is in rotation.", labels=["replica"]
        )
        inflight = GaugeMetricFamily(
            P + "replica_requests_inflight",
            "Requests this router has in flight on the replica.",
            labels=["replica"],
        )
        queued = GaugeMetricFamily(
            P + "replica_queued_prefill_tokens",
            "Queued prefill tokens the replica last reported.",
            labels=["replica"],
        )
        for r in self.replicas:
            up.add_metric([r.url], 1.0 if r.up else 0.0)
            inflight.add_metric([r.url], r.state.inflight)
            queued.add_metric([r.url], r.state.queued_prefill_tokens)
        return [up, inflight, queued]


class _ProxyStream(ClosingStreamingResponse):
    """A proxied stream whose upstream is closed however the response ends, even when its body
    generator never started (a client gone before the first send)."""

    def __init__(self, *args: Any, cleanup: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.cleanup = cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.cleanup()


class RouterMetrics:
    def __init__(self, replicas: ReplicaSet) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            P + "requests",
            "Requests proxied, by replica and HTTP status.",
            ["replica", "status"],
            registry=self.registry,
        )
        self.failures = Counter(
            P + "replica_failures",
            "Requests a replica failed while serving them, or refused before starting them.",
            ["replica", "kind"],
            registry=self.registry,
        )
        self.retries = Counter(
            P + "retries",
            "Requests sent to another replica after one refused them.",
            registry=self.registry,
        )
        self.handovers = Counter(
            P + "kv_handovers",
            "Requests prefilled on a prefill replica and continued on a decode replica.",
            registry=self.registry,
        )
        self.relayed = Counter(
            P + "kv_relayed_bytes",
            "KV segment bytes moved over HTTP between replicas on different hosts.",
            registry=self.registry,
        )
        self.no_replica = Counter(
            P + "no_replica", "Requests refused with 503: no replica up.", registry=self.registry
        )
        self.registry.register(_ReplicaCollector(replicas))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class Router:
    """Route handlers and state of one router app."""

    def __init__(
        self,
        replicas: ReplicaSet,
        policy: Policy,
        body_timeout_s: float,
        stream_timeout_s: float | None,
        internal_key: str | None = None,
    ) -> None:
        self.replicas = replicas
        self.internal = internal_headers(internal_key)  # sent on internal calls to replicas
        self.policy = policy
        self.body_timeout_s = body_timeout_s
        self.stream_timeout_s = stream_timeout_s
        self.metrics = RouterMetrics(replicas)
        self.client: httpx.AsyncClient | None = None

    # -- proxying ---------------------------------------------------------------------------------

    def _pick(self, prompt: PromptInfo, tried: set[str], role: str | None = None) -> Replica | None:
        states = [
            s
            for s in self.replicas.states()
            if s.url not in tried and (role is None or s.role == role)
        ]
        state = (
            self.policy.choose(states, prompt)
            if role != "decode"
            else self.policy.choose_decode(states)
        )
        return None if state is None else self.replicas.by_state(state)

    def disaggregated(self) -> bool:
        """Whether a prefill and a decode replica are both up and the router holds the internal
        key the hand-over needs (requests are then handed over)."""
        if not self.internal:
            return False
        roles = {s.role for s in self.replicas.states() if s.up}
        return "prefill" in roles and "decode" in roles

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "/v1/completions", chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, "/v1/chat/completions", chat=True)

    async def _guarded(self, replica: Replica, ticket: Ticket, aw: Awaitable[Any]) -> Any:
        with replica.guard(ticket):
            return await aw

    async def _generate(self, request: Request, path: str, chat: bool) -> Response:
        body = await read_body(request, self.body_timeout_s)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the replica answers the 400
        prompt = prompt_info(parsed, chat)
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        if self.disaggregated():
            return await self._handover(request, path, body, prompt, headers)
        tried: set[str] = set()
        while True:
            replica = self._next_replica(prompt, tried)
            out = await self._attempt(
                request, replica, replica.dispatch(prompt), path, body, headers
            )
            if out is not None:
                return out  # else refused before starting: try another

    async def _handover(
        self, request: Request, path: str, body: bytes, prompt: PromptInfo, headers: dict[str, str]
    ) -> Response:
        """Prefill on a prefill replica, then continue on a decode replica (module doc)."""
        tried: set[str] = set()
        while True:
            replica = self._next_replica(prompt, tried, "prefill")
            ticket = replica.dispatch(prompt)
            try:
                resp = await self._send(
                    request,
                    replica,
                    ticket,
                    path,
                    body,
                    {**headers, **self.internal, PREFILL_HEADER: "1"},
                )
                if resp is None:
                    self.metrics.retries.inc()
                    continue
                data = (
                    resp.content
                    if resp.is_closed
                    else await self._read(request, replica, ticket, resp)
                )
            finally:
                ticket.done()
            self.metrics.requests.labels(replica.url, str(resp.status_code)).inc()
            if resp.status_code != 200:  # the request's own error (400, ...): the client's answer
                return Response(
                    data,
                    resp.status_code,
                    media_type=resp.headers.get("content-type", "application/json"),
                )
            try:
                segments = json.loads(data)["kv_segments"]
                assert isinstance(segments, list) and all(isinstance(x, str) for x in segments)
            except (ValueError, KeyError, TypeError, AssertionError):
                raise APIError(
                    502,
                    f"prefill replica {replica.url} answered without KV segments; "
                    "is it a slimserve server of this version?",
                    code="replica_failed",
                ) from None
            break
        self.metrics.handovers.inc()
        prefill, tried = replica, set()
        while True:
            replica = self._next_replica(PromptInfo(1), tried, "decode")
            relay = prefill.state.kv_host != replica.state.kv_host and None not in (
                prefill.state.kv_host,
                replica.state.kv_host,
            )  # an older server: one host
            if relay:  # runtime/router/relay.py
                assert self.client is not None
                names = await relay_segments(
                    self.client,
                    prefill.url,
                    replica.url,
                    segments,
                    self.internal,
                    self.metrics.relayed.inc,
                )
            else:
                names = segments
            kv = {**headers, **self.internal, KV_HEADER: ",".join(names)}
            out = await self._attempt(
                request, replica, replica.dispatch(PromptInfo(1)), path, body, kv
            )
            if out is not None:
                return out
            if relay:  # the prefill side handed its segments out to this one: nothing left to move
                raise APIError(
                    503,
                    f"decode replica {replica.url} refused the request after its "
                    "KV was moved there; retry",
                    code="no_replica",
                    headers={"Retry-After": "1"},
                )
            # else refused before reading the segments: the next one may take it

    def _next_replica(
        self, prompt: PromptInfo, tried: set[str], role: str | None = None
    ) -> Replica:
        """The policy's pick among the replicas (of `role`) not tried yet, now counted as tried;
        a 503 when none is left."""
        replica = self._pick(prompt, tried, role)
        if replica is None:
            self.metrics.no_replica.inc()
            kind = f"{role} replica" if role else "replica"
            what = f"every {kind} refused the request" if tried else f"no {kind} is up"
            raise APIError(
                503, f"{what}; retry later", code="no_replica", headers={"Retry-After": "1"}
            )
        tried.add(replica.url)
        return replica

    async def _attempt(
        self,
        request: Request,
        replica: Replica,
        ticket: Ticket,
        path: str,
        body: bytes,
        headers: dict[str, str],
    ) -> Response | None:
        """Send to `replica` and relay its answer; None (ticket closed, a retry counted) when it
        refused before starting the request, so the caller tries another."""
        try:
            resp = await self._send(request, replica, ticket, path, body, headers)
        except BaseException:
            ticket.done()
            raise
        if resp is None:
            ticket.done()
            self.metrics.retries.inc()
            return None
        try:
            return await self._relay(request, replica, ticket, resp)
        except BaseException:
            ticket.done()
            with anyio.CancelScope(shield=True):
                await resp.aclose()
            raise

    async def _send(
        self,
        request: Request,
        replica: Replica,
        ticket: Ticket,
        path: str,
        body: bytes,
        headers: dict[str, str],
    ) -> httpx.Response | None:
        """The replica's response (headers only); None when it refused before starting."""
        assert self.client is not None
        req = self.client.build_request("POST", replica.url + path, content=body, headers=headers)
        try:
            resp = await unless_disconnected(
                request, self._guarded(replica, ticket, self.client.send(req, stream=True))
            )
        except ClientGone:
            raise APIError(CLIENT_CLOSED, "client closed the request") from None
        except (httpx.ConnectError, httpx.ConnectTimeout) as e:
            self.metrics.failures.labels(replica.url, "connect").inc()
            replica.mark_down(f"connection failed: {type(e).__name__}: {e}")
            return None
        except (ReplicaFailed, httpx.HTTPError) as e:
            raise self._failed(replica, e) from None
        if resp.status_code == 503:
            data = await self._read(request, replica, ticket, resp)
            try:
                code = json.loads(data)["error"]["code"]
            except Exception:
                code = None
            if code in RETRYABLE_503:
                self.metrics.failures.labels(replica.url, f"refused_{code}").inc()
                if code != "queue_full":  # a dead or stopping engine: out until it is healthy
                    replica.mark_down(f"refused a request: {code}")
                return None
        return resp  # a 503 of another kind is answered as it is (already read)

    def _failed(self, replica: Replica, e: Exception) -> APIError:
        """The 502 for a request its replica failed before answering: taken out of rotation
        already (ReplicaFailed), or lost now (an HTTP error: taken out here)."""
        if isinstance(e, ReplicaFailed):
            self.metrics.failures.labels(replica.url, "down").inc()
            why = str(e)
        else:
            self.metrics.failures.labels(replica.url, "lost").inc()
            why = f"{type(e).__name__}: {e}"
            replica.mark_down(why)
        return APIError(
            502,
            f"replica {replica.url} failed while serving the request: {why}",
            code="replica_failed",
        )

    async def _read(
        self, request: Request, replica: Replica, ticket: Ticket, resp: httpx.Response
    ) -> bytes:
        try:
            return await unless_disconnected(request, self._guarded(replica, ticket, resp.aread()))
        except ClientGone:
            raise APIError(CLIENT_CLOSED, "client closed the request") from None
        except (ReplicaFailed, httpx.HTTPError) as e:
            raise self._failed(replica, e) from None
        finally:
            await resp.aclose()

    async def _relay(
        self, request: Request, replica: Replica, ticket: Ticket, resp: httpx.Response
    ) -> Response:
        # the replica sends its headers once the first output exists: prefill is over
        ticket.first_token()
        media = resp.headers.get("content-type", "application/json")
        if resp.status_code != 200 or not media.startswith("text/event-stream"):
            data = (
                resp.content if resp.is_closed else await self._read(request, replica, ticket, resp)
            )
            ticket.done()
            self.metrics.requests.labels(replica.url, str(resp.status_code)).inc()
            extra = {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}
            return Response(data, resp.status_code, headers=extra, media_type=media)
        self.metrics.requests.labels(replica.url, "200").inc()

        async def cleanup() -> None:
            ticket.done()
            await resp.aclose()  # a client gone mid-stream: the replica sees it and aborts

        return _ProxyStream(
            self._events(replica, ticket, resp),
            cleanup=cleanup,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
            send_timeout=self.stream_timeout_s,
        )

    async def _events(
        self, replica: Replica, ticket: Ticket, resp: httpx.Response
    ) -> AsyncIterator[bytes]:
        """The replica's SSE events, each forwarded once it is complete; an error event and
        [DONE] when the replica fails mid-stream or ends it without [DONE]."""
        chunks = resp.aiter_bytes()
        buf, done = b"", False
        try:
            while True:
                try:
                    with replica.guard(ticket):
                        chunk = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                buf += chunk.replace(b"\r\n", b"\n")
                if b"\n\n" not in buf:
                    continue
                complete, _, buf = buf.rpartition(b"\n\n")
                complete += b"\n\n"
                done = done or complete.endswith(DONE) or b"\ndata: [DONE]\n\n" in complete
                yield complete
            if not done:
                raise ReplicaFailed("the replica ended the stream without [DONE]")
        except (ReplicaFailed, httpx.HTTPError) as e:
            if isinstance(e, httpx.HTTPError):
                replica.mark_down(f"{type(e).__name__}: {e}")
            self.metrics.failures.labels(replica.url, "stream").inc()
            msg = f"replica {replica.url} failed while streaming the request: {e}"
            yield _sse(error_body(msg, "server_error", code="replica_failed"))
            yield DONE
        finally:
            ticket.done()
            with anyio.CancelScope(shield=True):
                await resp.aclose()

    # -- the rest of the API -------------------------------------------------------------------

    async def _get(self, request: Request, path: str) -> Response:
        """A GET answered by the first replica up that answers it."""
        assert self.client is not None
        headers = {k: v for k, v in request.headers.items() if k in FORWARDED_HEADERS}
        for replica in self.replicas:
            if not replica.up:
                continue
            try:
                r = await self.client.get(replica.url + path, headers=headers, timeout=10)
            except httpx.HTTPError as e:
                replica.mark_down(f"{type(e).__name__}: {e}")
                continue
            return Response(
                r.content,
                r.status_code,
                media_type=r.headers.get("content-type", "application/json"),
            )
        raise APIError(
            503, "no replica is up; retry later", code="no_replica", headers={"Retry-After": "1"}
        )

    async def models(self, request: Request) -> Response:
        return await self._get(request, "/v1/models")

    async def model(self, request: Request, model_id: str) -> Response:
        return await self._get(request, f"/v1/models/{model_id}")

    async def health(self) -> Response:
        up = sum(r.up for r in self.replicas)
        if up == 0:
            return JSONResponse(error_body("no replica is up", "server_error"), 503)
        return JSONResponse({"status": "ok", "replicas_up": up, "replicas": len(self.replicas)})

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self, request: Request) -> Response:
        """POST /reset_prefix_cache to every replica up, and forget what the prefix affinity
        remembers of each; 200 when every replica up answered 200, else 502 with each answer."""
        assert self.client is not None
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        headers.update(self.internal)
        answers: dict[str, Any] = {}
        for replica in self.replicas:
            replica.state.prefixes = PrefixIndex()
            if not replica.up:
                answers[replica.url] = "down"
                continue
            try:
                r = await self.client.post(
                    replica.url + "/reset_prefix_cache", headers=headers, timeout=10
                )
                answers[replica.url] = r.status_code
            except httpx.HTTPError as e:
                answers[replica.url] = f"{type(e).__name__}: {e}"
        ok = all(a in (200, "down") for a in answers.values())
        return JSONResponse(
            {"status": "ok" if ok else "failed", "replicas": answers}, 200 if ok else 502
        )

    def _describe(self) -> dict[str, Any]:
        probe = prompt_info({"prompt": "x" * 400}, chat=False)  # a 100-token request
        out = []
        for r in self.replicas:
            d = r.describe()
            d["predicted_ttft_s_100_tokens"] = predicted_ttft(r.state, probe) if r.up else None
            out.append(d)
        return {"policy": self.policy.name, "replicas": out}

    async def list_replicas(self) -> dict[str, Any]:
        return self._describe()

    async def add_replica(self, request: Request) -> Response:
        url = await self._url_of(request)
        try:
            replica = self.replicas.add(url)
        except ValueError as e:
            raise APIError(400, str(e), param="url") from None
        assert self.client is not None
        await replica.poll(self.client)  # answer with its state, up or not
        return JSONResponse(replica.describe(), 201 if replica.up else 202)

    async def remove_replica(self, request: Request) -> Response:
        url = await self._url_of(request)
        try:
            replica = self.replicas.remove(url)
        except ValueError as e:
            raise APIError(400, str(e), param="url") from None
        if replica is None:
            raise APIError(404, f"no replica {url}", param="url")
        return JSONResponse({"removed": replica.url})

    async def _url_of(self, request: Request) -> str:
        url = request.query_params.get("url")
        if url is None:
            try:
                url = json.loads(await read_body(request, self.body_timeout_s) or b"{}").get("url")
            except (ValueError, AttributeError):
                url = None
        if not isinstance(url, str):
            raise APIError(400, 'send {"url": "http://host:port"} or ?url=', param="url")
        return url


def admin_auth(admin_key: str | None):
    async def check(request: Request) -> None:
        if admin_key is None:
            raise APIError(
                403,
                "the replica list is fixed: start the router with --admin-key "
                "to add and remove replicas at run time",
                code="admin_disabled",
            )
        if not bearer_matches(request, admin_key):
            raise APIError(
                401,
                "missing or incorrect admin key",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    return check


def build_router_app(
    replica_urls: list[str],
    *,
    policy: str = "least-latency",
    api_key: str | None = None,
    admin_key: str | None = None,
    poll_interval_s: float = POLL_INTERVAL_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    stream_timeout_s: float | None = DEFAULT_STREAM_TIMEOUT_S,
    internal_key: str | None = None,
) -> FastAPI:
    """The router app over `replica_urls` (more can be added at run time with `admin_key`).

    api_key: require `Authorization: Bearer <api_key>` on /v1/* and GET /router/replicas; the
    header is forwarded to the replicas, which may check it too.
    internal_key: the deployment's internal key (runtime/server/trust.py), sent to the replicas
    on hand-overs, segment moves and POST /reset_prefix_cache, and required from callers of
    the router's own POST /reset_prefix_cache; without one the router never hands over.
    """
    replicas = ReplicaSet(replica_urls)
    router = Router(replicas, make_policy(policy), body_timeout_s, stream_timeout_s, internal_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # A replica closes a keep-alive connection idle for KEEP_ALIVE_S (runtime/cli.py; 5 s
        # for an older server); a pooled connection reused just as a replica closes it fails
        # with "Server disconnected without sending a response", which would take a healthy
        # replica out: expire ours sooner.
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0
        )
        timeout = httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=None, write=30.0, pool=None)
        async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
            router.client = client
            await replicas.poll_all(client)  # know who is up before the first request
            poller = asyncio.ensure_future(replicas.poll_forever(client, poll_interval_s))
            try:
                yield
            finally:
                poller.cancel()
                with anyio.CancelScope(shield=True):
                    await asyncio.wait({poller})

    app = FastAPI(title="slimserve router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)
    app.add_api_route("/health", router.health, methods=["GET"])
    app.add_api_route("/metrics", router.metrics_text, methods=["GET"])
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(api_key))])
    v1.add_api_route("/models", router.models, methods=["GET"])
    v1.add_api_route("/models/{model_id:path}", router.model, methods=["GET"])
    v1.add_api_route("/completions", router.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", router.chat, methods=["POST"])
    app.include_router(v1)
    app.add_api_route(
        "/reset_prefix_cache",
        router.reset_prefix_cache,
        methods=["POST"],
        dependencies=[Depends(internal_auth(internal_key, "POST /reset_prefix_cache"))],
    )
    app.add_api_route(
        "/router/replicas",
        router.list_replicas,
        methods=["GET"],
        dependencies=[Depends(bearer_auth(api_key))],
    )
    app.add_api_route(
        "/router/replicas",
        router.add_replica,
        methods=["POST"],
        dependencies=[Depends(admin_auth(admin_key))],
    )
    app.add_api_route(
        "/router/replicas",
        router.remove_replica,
        methods=["DELETE"],
        dependencies=[Depends(admin_auth(admin_key))],
    )
    return app
