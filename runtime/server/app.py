"""The OpenAI-compatible HTTP server over an AsyncEngine (the interface it uses: docs/architecture.md,
"The engine interface the server uses").

Endpoints: POST /v1/completions, POST /v1/chat/completions (both stream over SSE), GET
/v1/models[/{id}], GET /health, GET /metrics, GET /state (the load a router polls: JSON), POST
/start_profile and /stop_profile (vLLM's names: a torch profiler trace of the engine steps in
between, runtime/stats/profiler.py; 400 unless the server was started with --profile-dir), POST
/reset_prefix_cache (vLLM's too: a benchmark's runs do not hit each other's prompts). Every
error is an OpenAI-style JSON body {"error": {"message", "type", "param", "code"}}; nothing
internal (tracebacks, paths) leaks.

A request that loses its client is aborted in the engine: while waiting for the first token and
for non-streamed answers a watcher awaits the ASGI `http.disconnect` message; a stream is
cancelled by Starlette when the client goes and its generator's `finally` aborts. A stream whose
client stops reading (a send blocked for `stream_timeout_s`) is ended and aborted the same way.

Hostile clients are answered cheaply, in this order: the body must arrive within
`body_timeout_s` and fit MAX_BODY_BYTES; a prompt longer in characters than the model's context
can hold is refused before it is tokenized; tokenizing and chat rendering run in worker threads,
never on the event loop; `max_queue` admission is checked and counted with no `await` in
between, so a burst cannot slip past it. The engine sends deltas (only what is new), so memory
held for a slow stream grows with its output, not with its output squared.

Prefill/decode disaggregation (runtime/disagg/protocol.py): a request with
`X-Slimserve-KV-Prefill: 1` is validated as usual, prefilled only, and answered with the names of
the shared-memory segments holding its KV; one with `X-Slimserve-KV: names` continues from those
segments and is answered as usual (each only on a server of that `--role`, which GET /state
reports). Between hosts the segments travel over HTTP: GET /kv_segments/{name} hands a prefill
server's segment out once, POST /kv_segments stores one on a decode server under a name of its
own (runtime/disagg/segment.py); /state's `kv_host` tells a router whether two servers share
shared memory.

Trust boundary (runtime/server/trust.py): the hand-over headers, /kv_segments and the admin
endpoints (/reset_prefix_cache, /start_profile, /stop_profile) need the deployment's internal
key in `X-Slimserve-Internal-Key` (403 on a server started without one, 401 without the right
one); a client's API key is not enough. Imported KV never serves another request
(runtime/engine/block_manager.py salts its blocks' keys). Stored segments are bounded in number and
bytes (503 + Retry-After beyond), and an upload must arrive within `body_timeout_s` (408, its
partial file removed). A request may carry `cache_salt` (vLLM's): only requests with the same
salt share prefix-cache blocks; `require_cache_salt` makes it mandatory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from slimserve.runtime.config import DEFAULT_BODY_TIMEOUT_S, DEFAULT_STREAM_TIMEOUT_S
from slimserve.runtime.disagg.errors import KVStoreFull, KVTransferError
from slimserve.runtime.disagg.protocol import KV_HEADER, PREFILL_HEADER, ROLES, parse_kv_header
from slimserve.runtime.disagg.segment import host_id, new_name, open_segment, receive_segment
from slimserve.runtime.engine.sequence import OutputAccumulator, RequestOutput, SamplingParams
from slimserve.runtime.errors import EngineDeadError, RequestError
from slimserve.runtime.server.http import (
    ClientGone,
    ClosingStreamingResponse,
    bearer_auth,
    check_internal_key,
    install_error_handlers,
    internal_auth,
    read_body,
    unless_disconnected,
)
from slimserve.runtime.server.metrics import RequestTracker, ServerMetrics
from slimserve.runtime.server.protocol import (
    MAX_PROMPTS,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    choice_params,
    error_body,
    parse_request,
    render_chat,
    sampling_params,
)
from slimserve.runtime.server.responses import (
    DONE,
    ChatFormat,
    CompletionFormat,
    _Format,
    delta,
    sse,
)
from slimserve.runtime.stats.profiler import ProfileError, ProfileStateError, ProfilingDisabled

log = logging.getLogger(__name__)
RETRY_AFTER_S = 1  # Retry-After (whole s) of a 503 for a full queue: the least there is
CLIENT_CLOSED = 499  # nginx's status for "client closed the request"; nobody reads it
SEGMENT_CHUNK_BYTES = 1 << 20  # a KV segment is sent in pieces of this size
DEFAULT_KV_SEGMENTS_MAX = 64  # KV segments a server holds at most (received and not imported)
# bytes of them at most, in prompts of the whole context (runtime/engine/async_engine.py
# `kv_segment_max_bytes` is one): what a few hand-overs of the longest prompts need at once
DEFAULT_KV_SEGMENTS_MAX_CONTEXTS = 4


class RequestFailed(Exception):
    """The engine failed this request alone (e.g. non-finite logits); the server goes on."""


@dataclass
class _Run:
    """One admitted request: its engine stream, first output and bookkeeping."""

    request_id: str
    gen: AsyncIterator[RequestOutput]  # the engine's generator, already past its first output
    first: RequestOutput
    tracker: RequestTracker
    finished: bool = False  # ended: the engine reported the end, or we aborted it
    num_tokens: int = 0  # completion tokens streamed so far (for usage)
    last: RequestOutput | None = None  # the latest delta (prompt ids, cached tokens, for usage)


async def _next(run: _Run) -> RequestOutput:
    """The run's next output; an engine stream that ends without a final output is an engine
    failure (and a StopAsyncIteration must not escape into an async generator)."""
    try:
        return await run.gen.__anext__()
    except StopAsyncIteration:
        raise EngineDeadError("the engine ended the request without a final output") from None


class OpenAIServing:
    """Route handlers; one instance per app."""

    def __init__(
        self,
        engine: Any,
        metrics: ServerMetrics,
        max_queue: int | None,
        body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
        stream_timeout_s: float | None = DEFAULT_STREAM_TIMEOUT_S,
        role: str = "colocated",
        kv_host: str | None = None,
        internal_key: str | None = None,
        require_cache_salt: bool = False,
        kv_segments_max: int = DEFAULT_KV_SEGMENTS_MAX,
        kv_segments_max_bytes: int | None = None,
    ) -> None:
        self.engine = engine
        self.internal_key = internal_key  # runtime/server/trust.py; None: internal calls refused
        self.require_cache_salt = require_cache_salt
        self.kv_segments_max = kv_segments_max
        self.kv_segments_max_bytes = kv_segments_max_bytes  # None: DEFAULT_KV_SEGMENTS_MAX_CONTEXTS
        self.role = role  # advertised in /state: a router sends prefill / decode work by it
        # advertised in /state: equal for servers sharing the KV segment folder (one host)
        self.kv_host = kv_host if kv_host is not None or role == "colocated" else host_id()
        self.metrics = metrics
        self.max_queue = max_queue  # refuse new requests while this many wait in the engine
        self.body_timeout_s = body_timeout_s
        self.stream_timeout_s = stream_timeout_s  # None: wait for a stalled reader forever
        self.pending = 0  # admitted requests without a first output yet (tokenizing or queued)
        self.created = int(time.time())  # the model's `created` in /v1/models
        self.active: set[str] = set()  # request ids admitted and not yet ended
        self.draining = False  # shutting down: refuse new requests

    def drain(self) -> None:
        """Server shutdown: abort every open request so that each ends now with finish_reason
        "abort" (streams get their last chunk and [DONE]) instead of being cancelled mid-send."""
        self.draining = True
        for request_id in list(self.active):
            self.engine.abort(request_id)

    # -- endpoints -------------------------------------------------------------------------------

    async def health(self) -> Response:
        problem = self.engine.health_problem()
        if problem is not None:
            return JSONResponse(
                error_body(f"engine is not healthy: {problem}", "server_error"), 503
            )
        return JSONResponse({"status": "ok"})

    async def state(self) -> Response:
        """The engine's load as JSON, for runtime/router/ (polled every ~150 ms): 503 with the
        same fields while /health would answer 503."""
        problem = self.engine.health_problem()
        try:
            s = self.engine.stats()
        except EngineDeadError as e:
            return JSONResponse(
                error_body(f"engine is not running: {e}", "server_error", code="engine_dead"), 503
            )
        body: dict[str, Any] = {
            "model": self.engine.model_name,
            "role": self.role,
            "kv_host": self.kv_host,
            "healthy": problem is None,
            "problem": problem,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_pending": self.pending,
            "kv_cache_usage": s.kv_cache_usage,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "block_size": s.block_size,
            "capacity_tokens": s.capacity_tokens,
            "max_model_len": self.engine.max_model_len,
            **dataclasses.asdict(self.engine.load()),
        }
        return JSONResponse(body, 200 if problem is None else 503)

    def _require_role(self, role: str, what: str, param: str | None = None) -> None:
        """A 400 `wrong_role` naming `what` unless this server was started with `--role role`."""
        if self.role != role:
            raise APIError(
                400,
                f"{what}: this server's role is {self.role}; it needs `runtime "
                f"serve --role {role}`",
                param=param,
                code="wrong_role",
            )

    async def send_segment(self, name: str) -> Response:
        """GET /kv_segments/{name}: a KV segment this prefill server wrote, handed out once
        (unlinked as it is opened; its memory goes when the answer is sent or abandoned)."""
        self._require_role("prefill", "GET /kv_segments")
        try:
            f, size = open_segment(name)
        except KVTransferError as e:
            raise APIError(e.status, str(e), param="name", code=e.code) from None
        self.engine.kv_segments.discard(name)  # handed out: no longer ours to expire

        async def body() -> AsyncIterator[bytes]:
            with f:
                while chunk := f.read(SEGMENT_CHUNK_BYTES):  # tmpfs: memory, no disk wait
                    yield chunk

        return ClosingStreamingResponse(
            body(), media_type="application/octet-stream", headers={"Content-Length": str(size)}
        )

    async def receive_segment(self, request: Request) -> Response:
        """POST /kv_segments: store a KV segment sent from a prefill server on another host
        (body: what GET /kv_segments/{name} answered); answers its name here, for X-Slimserve-KV.
        Refused with 503 + Retry-After while the stored segments are at their count or byte
        limit, 408 when the body has not all arrived within the body timeout."""
        self._require_role("decode", "POST /kv_segments")
        one = self.engine.kv_segment_max_bytes()
        total = self.kv_segments_max_bytes or DEFAULT_KV_SEGMENTS_MAX_CONTEXTS * one
        name = None
        try:
            with anyio.move_on_after(self.body_timeout_s):
                name = await receive_segment(
                    request.stream(),
                    one,
                    self.engine.kv_segments,
                    max_count=self.kv_segments_max,
                    max_bytes=total,
                )
        except KVStoreFull as e:
            raise APIError(
                e.status, str(e), code=e.code, headers={"Retry-After": str(RETRY_AFTER_S)}
            ) from None
        except KVTransferError as e:
            raise APIError(e.status, str(e), code=e.code) from None
        if name is None:  # cut off: receive_segment removed the partial file
            raise APIError(
                408,
                f"KV segment upload not received within {self.body_timeout_s:g} s (--body-timeout)",
                code="body_timeout",
            )
        return JSONResponse({"kv_segment": name}, 201)

    async def metrics_text(self) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self) -> Response:
        """Forget the prefix cache (blocks held by running requests stay theirs)."""
        try:
            await self.engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise APIError(503, f"engine is not running: {e}", code="engine_dead") from None
        return JSONResponse({"status": "ok"})

    async def start_profile(self, request: Request) -> Response:
        """Start a torch profiler trace of the engine's steps. Optional JSON body:
        {"record_shapes": bool (default false), "max_steps": int >= 1 (the cap, default and
        at most runtime/stats/profiler.py PROFILE_MAX_STEPS; the answer gives the cap in force)}."""
        opts = _profile_options(await read_body(request, self.body_timeout_s))
        cap = await self._profile_call(self.engine.start_profile(**opts))
        return JSONResponse({"status": "profiling", "max_steps": cap})

    async def stop_profile(self) -> Response:
        """Stop the trace and write it; answers with the file's name in the --profile-dir (never
        the server's absolute path)."""
        result = await self._profile_call(self.engine.stop_profile())
        return JSONResponse(
            {
                "status": "stopped",
                "path": os.path.basename(result.path),
                "steps": result.steps,
                "capped": result.capped,
            }
        )

    @staticmethod
    async def _profile_call(call: Any) -> Any:
        try:
            return await call
        except ProfilingDisabled as e:
            raise APIError(400, str(e), code="profiling_disabled") from None
        except ProfileStateError as e:
            raise APIError(409, str(e), code="profile_state") from None
        except ProfileError as e:
            raise APIError(500, str(e), code="profile_write_failed") from None
        except EngineDeadError as e:
            raise APIError(503, f"engine is not running: {e}", code="engine_dead") from None

    def _card(self) -> dict[str, Any]:
        return {
            "id": self.engine.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "slimserve",
            "max_model_len": self.engine.max_model_len,
        }

    async def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._card()]}

    async def model(self, model_id: str) -> dict[str, Any]:
        self._check_model(model_id)
        return self._card()

    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = parse_request(
            await read_body(request, self.body_timeout_s), CompletionRequest
        )
        self._check_model(req.model)
        self._check_cache_salt(req.cache_salt)
        prompts = req.prompt  # one or more (runtime/server/protocol.py CompletionRequest)
        if len(prompts) * req.n > MAX_PROMPTS:
            raise APIError(
                400,
                f"n: {len(prompts)} prompts x n={req.n} make {len(prompts) * req.n} choices; "
                f"at most {MAX_PROMPTS} are served per request",
                param="n",
            )
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise APIError(
                400,
                "max_tokens: must be >= 1; 0 is served only with echo: true (the prompt alone, "
                "with its logprobs when logprobs is set)",
                param="max_tokens",
            )
        # max_tokens 0 with echo: the prompt alone (scoring), as vLLM; the engine still
        # generates one token, which the answer leaves out
        hide_output = max_tokens == 0 and req.echo
        if req.stream and req.prompt_logprobs is not None:
            raise APIError(
                400,
                "prompt_logprobs: not served with stream=true (as vLLM); use echo with "
                "logprobs to stream the prompt's logprobs",
                param="prompt_logprobs",
            )
        # vLLM: echo with logprobs returns the prompt tokens' logprobs too
        wanted = [req.prompt_logprobs, req.logprobs if req.echo else None]
        prompt_lps = max((k for k in wanted if k is not None), default=None)
        params = sampling_params(
            req,
            max_tokens=1 if hide_output else max_tokens,
            logprobs=req.logprobs,
            max_model_len=self.engine.max_model_len,
            prompt_logprobs=prompt_lps,
        )
        for p in prompts:
            self._check_prompt_size(p, "prompt")
        echo = None
        if req.echo:
            echo = await asyncio.to_thread(
                lambda: [p if isinstance(p, str) else self._decode(p) for p in prompts]
            )
        rid = f"cmpl-{uuid.uuid4().hex}"
        fmt = CompletionFormat(
            rid,
            self.engine.model_name,
            int(time.time()),
            self.engine.tokenizer,
            logprobs=req.logprobs is not None,
            echo=echo,
            n=req.n,
            top_logprobs=req.logprobs or 0,
            prompt_logprobs=req.prompt_logprobs,
            hide_output=hide_output,
            include_usage=req.include_usage,
        )
        return await self._answer(request, prompts, params, fmt, n=req.n, stream=req.stream)

    async def chat(self, request: Request) -> Response:
        req: ChatCompletionRequest = parse_request(
            await read_body(request, self.body_timeout_s), ChatCompletionRequest
        )
        self._check_model(req.model)
        self._check_cache_salt(req.cache_salt)
        logprobs = chat_logprobs(req)
        self._check_prompt_size("".join(m.content for m in req.messages), "messages")
        ids = await asyncio.to_thread(render_chat, self.engine.tokenizer, req.messages)
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        if max_tokens is None:  # OpenAI's chat default: whatever the context leaves
            max_tokens = max(1, self.engine.max_model_len - len(ids))
        params = sampling_params(
            req, max_tokens=max_tokens, logprobs=logprobs, max_model_len=self.engine.max_model_len
        )
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormat(
            rid,
            self.engine.model_name,
            int(time.time()),
            self.engine.tokenizer,
            logprobs=logprobs is not None,
            include_usage=req.include_usage,
        )
        # the engine only sees token ids, so a too-long prompt is the messages' fault
        names = {"prompt": "messages"}
        if req.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return await self._answer(
            request, [ids], params, fmt, n=req.n, stream=req.stream, field_names=names
        )

    # -- shared ----------------------------------------------------------------------------------

    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.engine.model_name:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.engine.model_name}`",
                param="model",
                code="model_not_found",
            )

    def _check_cache_salt(self, salt: str | None) -> None:
        if salt is None and self.require_cache_salt:
            raise APIError(
                400,
                "cache_salt: this server requires one per request (--require-"
                'cache-salt); send your tenant\'s salt, e.g. "cache_salt": '
                '"tenant-a"',
                param="cache_salt",
            )

    def _check_prompt_size(self, prompt: str | list[int], field: str) -> None:
        """Refuse, before any tokenizing or decoding, a prompt that cannot fit the context."""
        limit = self.engine.max_model_len
        if isinstance(prompt, list) and len(prompt) >= limit:
            raise APIError(
                400,
                f"{field}: has {len(prompt)} tokens; this model's maximum context "
                f"length is {limit}",
                param=field,
            )
        if isinstance(prompt, str) and len(prompt) > self.engine.max_prompt_chars:
            raise APIError(
                400,
                f"{field}: has {len(prompt)} characters, more than {limit} tokens "
                f"of this model's tokenizer can hold ({self.engine.max_prompt_chars}); "
                f"this model's maximum context length is {limit}",
                param=field,
            )

    def _decode(self, ids: list[int]) -> str:
        """The text of a token-id prompt, for echo (before the engine has checked the ids)."""
        if self.engine.tokenizer is None:
            raise APIError(
                400, "echo: this model has no tokenizer to decode the prompt", param="echo"
            )
        try:
            return self.engine.tokenizer.decode(ids)
        except Exception:  # ids outside the vocabulary: each tokenizer fails its own way
            raise APIError(
                400,
                "prompt: token ids cannot be decoded; are they outside the vocabulary?",
                param="prompt",
            ) from None

    def _admit(self) -> None:
        """Count the request as pending, or refuse it with 503 + Retry-After while the queue is
        full. Check and count happen with no `await` between them: a burst cannot overshoot."""
        if self.draining:
            raise APIError(503, "server is shutting down", code="shutting_down")
        if self.max_queue is not None:
            try:
                waiting = max(self.pending, self.engine.stats().num_waiting)
            except EngineDeadError as e:
                raise APIError(503, f"engine is not running: {e}", code="engine_dead") from None
            if waiting >= self.max_queue:
                self.metrics.request_rejected.labels(reason="queue_full").inc()
                raise APIError(
                    503,
                    f"server is busy: {waiting} requests are waiting (limit "
                    f"{self.max_queue}); retry later",
                    code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
        self.pending += 1

    async def _start(
        self,
        request: Request,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        kv: dict[str, str] | None = None,
        watch: bool = True,
    ) -> _Run:
        """Submit to the engine and wait for the first output (where it validates the prompt).
        watch=False: the caller watches for the client's disconnect (and cancels us)."""
        self._admit()
        try:
            gen = self.engine.generate(prompt, params, request_id, **(kv or {}))
            tracker = self.metrics.track()
            self.active.add(request_id)
            try:
                first = await (
                    unless_disconnected(request, gen.__anext__()) if watch else gen.__anext__()
                )
            except (ClientGone, asyncio.CancelledError):
                self.active.discard(request_id)
                self.engine.abort(request_id)
                tracker.finish("abort")
                raise
            except BaseException:
                self.active.discard(request_id)
                raise
        finally:
            self.pending -= 1
        return _Run(request_id, gen, first, tracker)

    async def _first(
        self,
        request: Request,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        field_names: dict[str, str],
        kv: dict[str, str] | None = None,
        watch: bool = True,
    ) -> _Run:
        """_start, with the engine's refusals turned into API errors."""
        try:
            return await self._start(request, prompt, params, request_id, kv, watch)
        except KVTransferError as e:
            raise APIError(e.status, str(e), param=KV_HEADER, code=e.code) from None
        except RequestError as e:
            param = field_names.get(e.field, e.field)
            msg = str(e).removeprefix(f"{e.field}: ")
            raise APIError(400, f"{param}: {msg}", param=param) from None
        except EngineDeadError as e:
            raise APIError(503, f"engine is not running: {e}", code="engine_dead") from None
        except StopAsyncIteration:
            raise APIError(500, "the engine ended the request without output") from None

    def _handover(self, request: Request, n: int) -> tuple[bool, list[str] | None]:
        """(prefill only?, segments to continue from) asked by a router's headers; a server
        hands over only in its role (a colocated one never touches shared memory)."""
        kv = request.headers.get(KV_HEADER)
        prefill = request.headers.get(PREFILL_HEADER, "").strip() in ("1", "true")
        if kv is not None and prefill:
            raise APIError(
                400, f"{PREFILL_HEADER} and {KV_HEADER}: send one of them", param=KV_HEADER
            )
        for asked, header, role in (
            (prefill, PREFILL_HEADER, "prefill"),
            (kv is not None, KV_HEADER, "decode"),
        ):
            if asked:  # the credential first: a client learns nothing else about hand-overs
                check_internal_key(request, self.internal_key, f"the {header} header")
                self._require_role(role, header, param=header)
        try:
            return prefill, None if kv is None else parse_kv_header(kv, n)
        except KVTransferError as e:
            raise APIError(e.status, str(e), param=KV_HEADER, code=e.code) from None

    async def _answer(
        self,
        request: Request,
        prompts: list[str | list[int]],
        params: SamplingParams,
        fmt: _Format,
        *,
        n: int,
        stream: bool,
        field_names: dict[str, str] | None = None,
    ) -> Response:
        prefill, segments = self._handover(request, n)
        if (prefill or segments) and len(prompts) > 1:
            raise APIError(
                400,
                "prompt: a prefill/decode hand-over serves one prompt per request; send one "
                "request per prompt",
                param="prompt",
            )
        if (prefill or segments) and params.prompt_logprobs is not None:
            # a decode server continues from handed-over KV: it never computes the prompt
            raise APIError(
                400,
                "logprobs: prompt logprobs (echo with logprobs, prompt_logprobs) are not served "
                "across a prefill/decode hand-over; send the request to a colocated server",
                param="logprobs",
            )
        if prefill:
            return await self._prefill_only(request, prompts[0], params, fmt, n, field_names or {})
        try:
            runs = await self._start_all(
                request, prompts, params, fmt.id, n, field_names or {}, segments
            )
            if stream:
                return ClosingStreamingResponse(
                    self._stream(runs, fmt),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache"},
                    send_timeout=self.stream_timeout_s,
                )
            finals = await unless_disconnected(request, self._collect_all(runs))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        if isinstance(fmt, CompletionFormat) and fmt.echo_logprobs:
            # a token string per prompt token and alternative: decoded off the event loop
            return JSONResponse(await asyncio.to_thread(fmt.response, finals))
        return JSONResponse(fmt.response(finals))

    async def _prefill_only(
        self,
        request: Request,
        prompt: str | list[int],
        params: SamplingParams,
        fmt: _Format,
        n: int,
        field_names: dict[str, str],
    ) -> Response:
        """Prefill each choice into a KV segment of its own; answer with the segment names."""
        names = [new_name() for _ in range(n)]
        try:
            runs = await self._start_all(
                request, [prompt], params, fmt.id, n, field_names, exports=names
            )
            finals = await unless_disconnected(request, self._collect_all(runs))
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        return JSONResponse(
            {"kv_segments": names, "prompt_tokens": len(finals[0].prompt_token_ids)}
        )

    async def _start_all(
        self,
        request: Request,
        prompts: list[str | list[int]],
        params: SamplingParams,
        request_id: str,
        n: int,
        field_names: dict[str, str],
        imports: list[str] | None = None,
        exports: list[str] | None = None,
    ) -> list[_Run]:
        """One engine request per choice, `n` per prompt, in prompt order (ids `<id>-<k>` for
        choice k when there are several). A prompt's choices start in turn, so later ones find
        the prompt in the prefix cache; several prompts start at once. A refusal ends the ones
        already started. imports / exports: per choice, the KV segment it continues from /
        prefills into (one prompt)."""
        total = len(prompts) * n
        rids = [request_id if total == 1 else f"{request_id}-{k}" for k in range(total)]
        if len(prompts) == 1:
            return await self._start_choices(
                request, prompts[0], params, rids, field_names, imports, exports
            )
        tasks = [
            asyncio.ensure_future(
                self._start_choices(
                    request, p, params, rids[j * n : (j + 1) * n], field_names, watch=False
                )
            )
            for j, p in enumerate(prompts)
        ]
        try:
            await unless_disconnected(request, asyncio.wait(tasks))
        finally:  # client gone or we were cancelled: the unfinished ones abort what they began
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks)
            failed = [t for t in tasks if t.cancelled() or t.exception() is not None]
            if failed:
                for task in tasks:
                    if task not in failed:
                        for run in task.result():
                            self.active.discard(run.request_id)
                            await self._abort(run)
        if failed:
            first = failed[0]
            raise ClientGone() if first.cancelled() else first.exception()  # type: ignore[misc]
        return [run for task in tasks for run in task.result()]

    async def _start_choices(
        self,
        request: Request,
        prompt: str | list[int],
        params: SamplingParams,
        rids: list[str],
        field_names: dict[str, str],
        imports: list[str] | None = None,
        exports: list[str] | None = None,
        watch: bool = True,
    ) -> list[_Run]:
        """One prompt's choices (engine ids `rids`), started in turn; a refusal ends the ones
        already started."""
        runs: list[_Run] = []
        try:
            for i, p in enumerate(choice_params(params, len(rids))):
                kv = (
                    {"kv_import": imports[i]}
                    if imports
                    else {"kv_export": exports[i]}
                    if exports
                    else {}
                )
                runs.append(await self._first(request, prompt, p, rids[i], field_names, kv, watch))
        except BaseException:
            for run in runs:
                self.active.discard(run.request_id)
                await self._abort(run)
            raise
        return runs

    async def _abort(self, run: _Run) -> None:
        """Stop a request the client no longer wants: tell the engine, close its stream."""
        run.finished = True
        run.tracker.finish("abort")
        self.engine.abort(run.request_id)
        with anyio.CancelScope(shield=True):  # close the engine stream even while cancelled
            try:
                await run.gen.aclose()  # type: ignore[attr-defined]
            except (RuntimeError, EngineDeadError):  # already closing elsewhere / engine gone
                pass

    async def _collect(self, run: _Run) -> RequestOutput:
        """The whole output of a non-streamed request, merged from its deltas."""
        acc = OutputAccumulator()
        try:
            out = run.first
            while True:
                run.tracker.update(out)
                acc.add(out)
                if out.finished:
                    run.finished = True
                    if out.error is not None:
                        raise APIError(
                            500, f"the request failed: {out.error}", code="request_failed"
                        )
                    return acc.take()  # type: ignore[return-value]
                out = await run.gen.__anext__()
        except StopAsyncIteration:
            raise APIError(500, "the engine ended the request without a final output") from None
        except EngineDeadError as e:
            raise APIError(
                503, f"engine stopped while serving the request: {e}", code="engine_dead"
            ) from None
        finally:
            self.active.discard(run.request_id)
            if not run.finished:
                await self._abort(run)

    async def _collect_all(self, runs: list[_Run]) -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(self._collect(run)) for run in runs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:  # one failed or we were cancelled: the others end (and abort) too
            for task in tasks:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait(tasks)
            for task in tasks:  # their errors are this one's, already raised
                if not task.cancelled():
                    task.exception()

    async def _outputs(self, runs: list[_Run]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta output) as the engine produces them, until all finish. The
        queue holds one item per choice at most: while the stream's client is slow, the deltas
        wait merged in the engine's mailbox of each choice (runtime/engine/async_engine.py)."""
        if len(runs) == 1:  # one choice: no queue, no pump task (a token's path is short)
            out = runs[0].first
            yield 0, out
            while not out.finished:
                out = await _next(runs[0])
                yield 0, out
            return
        queue: asyncio.Queue = asyncio.Queue(maxsize=len(runs))

        async def pump(i: int, run: _Run) -> None:
            try:
                out = run.first
                while True:
                    await queue.put((i, out, None))
                    if out.finished:
                        return
                    out = await _next(run)
            except Exception as e:
                await queue.put((i, None, e))

        pumps = [asyncio.ensure_future(pump(i, run)) for i, run in enumerate(runs)]
        try:
            left = len(runs)
            while left:
                i, out, err = await queue.get()
                if err is not None:
                    raise err
                yield i, out
                left -= out.finished
        finally:
            for task in pumps:
                task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait(pumps)

    async def _stream(self, runs: list[_Run], fmt: _Format) -> AsyncIterator[str]:
        try:
            for chunk in fmt.opening(len(runs)):
                yield sse(chunk)
            async with aclosing(self._outputs(runs)) as outputs:
                async for i, out in outputs:
                    run = runs[i]
                    run.tracker.update(out)
                    d = delta(out)
                    run.num_tokens += fmt.completion_tokens(d)
                    run.last, run.finished = out, out.finished
                    if out.error is not None:
                        raise RequestFailed(out.error)
                    if d.text or d.token_ids or d.finish_reason:
                        if isinstance(fmt, CompletionFormat) and fmt.echo_logprobs:
                            # the first chunk decodes every prompt token: off the event loop
                            yield sse(await asyncio.to_thread(fmt.chunk, d, i))
                        else:
                            yield sse(fmt.chunk(d, i))
            if fmt.include_usage:
                yield sse(
                    fmt.usage_chunk(
                        [run.last or run.first for run in runs], [run.num_tokens for run in runs]
                    )
                )
        except Exception as e:  # headers are sent: report in-band, as vLLM does
            if isinstance(e, EngineDeadError):
                err = error_body(f"engine stopped while serving the request: {e}", "server_error")
            elif isinstance(e, RequestFailed):
                err = error_body(f"the request failed: {e}", "server_error", code="request_failed")
            else:
                log.exception("stream of %s failed", fmt.id)
                err = error_body("internal server error", "server_error")
            yield sse(err)
        finally:
            for run in runs:
                self.active.discard(run.request_id)
                if not run.finished:  # client gone (cancelled) or failed: free the engine's blocks
                    await self._abort(run)
        yield DONE


def _profile_options(body: bytes) -> dict[str, Any]:
    """The optional JSON body of POST /start_profile, checked: one 400 line per bad field."""
    if not body.strip():
        return {}
    try:
        data = json.loads(body)
    except ValueError:
        raise APIError(
            400, 'body: not valid JSON; send {} or {"max_steps": N, "record_shapes": true}'
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, 'body: must be a JSON object such as {"max_steps": 100}')
    if unknown := sorted(set(data) - {"record_shapes", "max_steps"}):
        raise APIError(
            400,
            f"{unknown[0]}: unknown field; the fields are record_shapes and max_steps",
            param=unknown[0],
        )
    opts: dict[str, Any] = {}
    if "record_shapes" in data:
        if not isinstance(data["record_shapes"], bool):
            raise APIError(
                400,
                f"record_shapes: {data['record_shapes']!r} is not true or false",
                param="record_shapes",
            )
        opts["record_shapes"] = data["record_shapes"]
    if data.get("max_steps") is not None:
        n = data["max_steps"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise APIError(400, f"max_steps: {n!r} must be an integer >= 1", param="max_steps")
        opts["max_steps"] = n
    return opts


def build_app(
    engine: Any,
    *,
    api_key: str | None = None,
    max_queue: int | None = None,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    stream_timeout_s: float | None = DEFAULT_STREAM_TIMEOUT_S,
    role: str = "colocated",
    kv_host: str | None = None,
    internal_key: str | None = None,
    require_cache_salt: bool = False,
    kv_segments_max: int = DEFAULT_KV_SEGMENTS_MAX,
    kv_segments_max_bytes: int | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine`; the lifespan starts it and shuts it down.

    api_key: require `Authorization: Bearer <api_key>` on /v1/* (/health, /metrics, /state stay
    open).
    internal_key: the deployment's internal credential (runtime/server/trust.py), required in
    `X-Slimserve-Internal-Key` by the KV hand-over (headers and /kv_segments) and the admin
    endpoints (/reset_prefix_cache, /start_profile, /stop_profile); None refuses them all (403).
    require_cache_salt: refuse (400) /v1 requests without `cache_salt`.
    kv_segments_max / kv_segments_max_bytes: the KV segments a decode server stores at most
    (count; bytes, default DEFAULT_KV_SEGMENTS_MAX_CONTEXTS whole-context prompts' worth).
    max_queue: answer 503 with Retry-After while this many admitted requests wait.
    body_timeout_s: answer 408 when a request body has not arrived within this.
    stream_timeout_s: end and abort a stream whose client has read nothing for this long.
    role: colocated | prefill | decode, advertised in /state for a router (runtime/disagg/); a
    prefill server also answers prefill-only requests, a decode one continues handed-over ones
    (both serve ordinary requests too, so a router without the other role still works).
    kv_host: what /state advertises as the KV segment host (default: runtime/disagg/segment.py
    `host_id`); a router relays segments over HTTP between servers whose kv_host differs.
    """
    if role not in ROLES:
        raise ValueError(f"role {role!r}: choose one of {', '.join(ROLES)}")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        try:
            yield
        finally:
            await engine.shutdown()  # pending requests finish with finish_reason "abort"

    app = FastAPI(title="slimserve", lifespan=lifespan)
    serving = OpenAIServing(
        engine,
        ServerMetrics(engine),
        max_queue,
        body_timeout_s,
        stream_timeout_s,
        role,
        kv_host,
        internal_key,
        require_cache_salt,
        kv_segments_max,
        kv_segments_max_bytes,
    )
    app.state.serving = serving
    install_error_handlers(app)
    app.add_api_route("/health", serving.health, methods=["GET"])
    app.add_api_route("/metrics", serving.metrics_text, methods=["GET"])
    app.add_api_route("/state", serving.state, methods=["GET"])
    for path, handler, method in (
        ("/start_profile", serving.start_profile, "POST"),
        ("/stop_profile", serving.stop_profile, "POST"),
        ("/reset_prefix_cache", serving.reset_prefix_cache, "POST"),
        ("/kv_segments/{name}", serving.send_segment, "GET"),
        ("/kv_segments", serving.receive_segment, "POST"),
    ):
        what = f"{method} {path.removesuffix('/{name}')}"
        app.add_api_route(
            path,
            handler,
            methods=[method],
            dependencies=[Depends(internal_auth(internal_key, what))],
        )
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(api_key))])
    v1.add_api_route("/models", serving.models, methods=["GET"])
    v1.add_api_route("/models/{model_id:path}", serving.model, methods=["GET"])
    v1.add_api_route("/completions", serving.completions, methods=["POST"])
    v1.add_api_route("/chat/completions", serving.chat, methods=["POST"])
    app.include_router(v1)
    return app
