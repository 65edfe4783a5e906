"""The OpenAI request side: pydantic models, OpenAI-style errors, SamplingParams, chat prompts.

Requests are parsed strictly (a string where a number belongs is an error, not coerced), so a
client bug surfaces as a 400 that names the field instead of a silently different request.
Fields we do not know are ignored, as OpenAI-compatible servers commonly do; fields we know but do
not serve (penalties, logit_bias, tools, ...) are refused unless they carry their neutral value,
because ignoring them would quietly change what the client asked for.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from slimserve.runtime.engine.sequence import MIN_TEMPERATURE, SamplingError, SamplingParams
from slimserve.runtime.engine.stops import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS  # noqa: F401 (re-exported)

MAX_BODY_BYTES = 32 * 2**20  # request bodies above this are refused (413) before parsing
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
MAX_CHOICES = 16  # the largest `n`: each choice is its own engine request
# the most choices one /v1/completions request makes (prompts x n): each is an engine request
MAX_PROMPTS = 256
# `stop` limits (defined in runtime/engine/stops.py, enforced by SamplingParams): more or longer stop
# strings are refused with a 400 naming the limit, so stop matching stays cheap per token.

# Known OpenAI/vLLM fields we do not implement -> the values that mean "off" and may pass.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
}

# The chat prompt for tokenizers without a chat template: one "Role: content" line per message,
# then "Assistant:" for the model to continue. Plain text, so any base model can follow it.
FALLBACK_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


class APIError(Exception):
    """An error answered as an OpenAI-style JSON body: {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status  # HTTP status code
        self.message = message
        self.param = param  # the offending request field, or None
        self.code = code  # machine-readable reason (e.g. "model_not_found")
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_message(body: bytes | str, limit: int = 200) -> str:
    """The message of an error answer read back (router, benchmark client): `error.message`
    of an `error_body`, a /state answer's `problem`, else the text itself cut to `limit`."""
    try:
        data = json.loads(body)
        return str(data.get("problem") or data["error"]["message"])
    except (ValueError, KeyError, TypeError, AttributeError):
        text = body.decode(errors="replace") if isinstance(body, bytes) else body
        return text.strip()[:limit]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Strict):
    include_usage: bool = False  # send a last chunk with `usage` (and choices []) before [DONE]


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None  # new tokens at most; None: the endpoint's default
    temperature: float | None = None  # None: 1.0; 0 = greedy
    top_p: float | None = None  # None: 1.0
    top_k: int | None = None  # None: -1 (off); a vLLM extension
    seed: int | None = None  # per-request sampling seed
    stop: list[str] | None = None  # stop strings; a single string is accepted too
    stop_token_ids: list[int] | None = None  # extra stop tokens (vLLM extension)
    ignore_eos: bool = False  # keep generating past EOS (vLLM extension; for benchmarks)
    stream: bool = False  # answer as server-sent events
    stream_options: StreamOptions | None = None  # only with stream=true
    n: int = 1  # choices per prompt, each its own engine request (seed + i when seeded)
    user: str | None = None  # end-user id; accepted and ignored
    # prefix-cache namespace (vLLM's): only requests with the same salt share cached prefixes
    cache_salt: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    @field_validator("n", mode="after")
    @classmethod
    def _choices(cls, v: int) -> int:
        if not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"must be between 1 and {MAX_CHOICES}, got {v}")
        return v


class CompletionRequest(_SamplingFields):
    prompt: Any  # one or more prompts, each a string or a list of token ids; validated below
    logprobs: int | None = None  # top-n logprobs per generated token (0 = chosen token only)
    # prepend the prompt to the returned text; with logprobs, the prompt tokens' logprobs come
    # first in `logprobs` (vLLM's layout: the first prompt token's are null)
    echo: bool = False
    # vLLM's extension: each choice also carries `prompt_logprobs`, the logprob of every prompt
    # token and this many alternatives, keyed by token id (not with stream=true, as vLLM)
    prompt_logprobs: int | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _prompts(cls, v: Any) -> list[str | list[int]]:
        """One prompt (a string, a list of token ids) or several (a list of strings, a list of
        token-id lists), as OpenAI; always returned as a list of prompts."""
        if isinstance(v, str) or (isinstance(v, list) and v and all(type(t) is int for t in v)):
            v = [v]
        if not isinstance(v, list) or not v:
            if isinstance(v, list):
                raise ValueError("is empty; send some text or token ids")
            raise ValueError("must be a string or a list of token ids (integers)")
        if len(v) > MAX_PROMPTS:
            raise ValueError(f"has {len(v)} prompts; at most {MAX_PROMPTS} are served per request")
        kinds = {type(p) for p in v}
        if kinds not in ({str}, {list}):
            raise ValueError(
                "must be a string, a list of token ids, a list of strings or a list of "
                "token-id lists (not a mix)"
            )
        for i, p in enumerate(v):
            where = f"prompt {i} " if len(v) > 1 else ""
            if not p:
                raise ValueError(f"{where}is empty; send some text or token ids")
            if isinstance(p, list) and not all(type(t) is int for t in p):
                raise ValueError(f"{where}must be a list of token ids (integers)")
        return v


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Any  # str, list of {"type": "text", "text": ...} parts, or null for assistant
    name: str | None = None  # accepted and ignored

    @field_validator("content", mode="plain")
    @classmethod
    def _text(cls, v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        if isinstance(v, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in v
        ):
            return "".join(p["text"] for p in v)
        raise ValueError(
            "must be a string or a list of {'type': 'text', 'text': ...} parts; "
            "only text content is served"
        )


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # newer OpenAI name for max_tokens; wins if both
    logprobs: bool = False  # return logprobs of the chosen tokens
    top_logprobs: int | None = None  # and this many alternatives per token (needs logprobs=true)

    @field_validator("messages", mode="after")
    @classmethod
    def _non_empty(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("is empty; send at least one message")
        return v


def parse_request(raw: bytes, model: type[_SamplingFields]) -> Any:
    """Body bytes -> a validated request model, or APIError(400) naming the first bad field."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly deep nesting
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise APIError(400, "request body must be a JSON object")
    for name, neutral in UNSUPPORTED.items():
        if name in data and not any(
            data[name] == ok and type(data[name]) is type(ok) for ok in neutral
        ):
            raise APIError(
                400,
                f"{name} is not supported by this server; leave it out",
                param=name,
                code="unsupported_parameter",
            )
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(p) for p in err["loc"]]
        path = ".".join(loc) or "body"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            msg = "is required"
        raise APIError(400, f"{path}: {msg}", param=loc[0] if loc else None) from None
    if req.stream_options is not None and not req.stream:
        raise APIError(
            400, "stream_options: only allowed when stream is true", param="stream_options"
        )
    return req


def sampling_params(
    req: _SamplingFields,
    *,
    max_tokens: int,
    logprobs: int | None,
    max_model_len: int,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """The engine's SamplingParams for a request; APIError(400) names the field out of range."""
    if max_tokens > max_model_len:
        field = (
            "max_completion_tokens"
            if getattr(req, "max_completion_tokens", None) is not None
            else "max_tokens"
        )
        raise APIError(
            400,
            f"{field}: {max_tokens} exceeds the maximum context length "
            f"{max_model_len} of this model",
            param=field,
        )
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise APIError(400, f"seed: must be a 64-bit integer, got {req.seed}", param="seed")
    temperature = 1.0 if req.temperature is None else req.temperature
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = 0.0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=list(req.stop or []),
            stop_token_ids=frozenset(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            cache_salt=req.cache_salt,
        )
    except SamplingError as e:
        raise APIError(400, str(e), param=e.field) from None


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: a seeded request samples choice i with seed + i (modulo
    2^64, the engine's seed range), so choices differ yet the whole answer is reproducible."""
    if n == 1:
        return [params]
    return [
        dataclasses.replace(params, seed=None if params.seed is None else (params.seed + i) % 2**64)
        for i in range(n)
    ]


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat's (logprobs: bool, top_logprobs: int) -> SamplingParams.logprobs (None = off)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs: needs logprobs=true", param="top_logprobs")
    if not req.logprobs:
        return None
    return req.top_logprobs or 0


def render_chat(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Token ids of the chat prompt: the tokenizer's chat template, else the plain fallback.

    The template already writes any BOS/special tokens it wants, so its text is tokenized without
    adding special tokens; the fallback text gets the tokenizer's usual ones (BOS, if any).
    """
    if tokenizer is None:
        raise APIError(
            400,
            "messages: this model has no tokenizer, so chat is not served; "
            "use /v1/completions with token ids",
            param="messages",
        )
    # "developer" is OpenAI's newer name for the system role; templates know "system".
    msgs = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.content}
        for m in messages
    ]
    if getattr(tokenizer, "chat_template", None):
        try:
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors come in many types (TemplateError, ValueError, ...)
            raise APIError(
                400, f"messages: the model's chat template rejected them: {e}", param="messages"
            ) from None
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(f"{FALLBACK_ROLE_NAMES[m['role']]}: {m['content']}\n" for m in msgs)
    return list(tokenizer.encode(text + "Assistant:", add_special_tokens=True))
