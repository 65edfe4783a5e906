"""Requests as the engine sees them: sampling parameters, a sequence's state, its outputs."""

from __future__ import annotations

import enum
import math
import struct
import time
from dataclasses import dataclass, field

from slimserve.runtime.engine.stops import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): fp32 logits divided by e.g.
# 1e-45 overflow to inf, the softmax turns NaN and torch.multinomial fails in the engine thread.
MIN_TEMPERATURE = 1e-5
MAX_CACHE_SALT_CHARS = 256  # the longest `cache_salt` a request may carry


class SamplingError(ValueError):
    """A sampling parameter is out of range; the message names the field and the allowed range."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name  # the offending parameter's name, for HTTP error bodies


@dataclass
class SamplingParams:
    """How to decode one request (the subset of vLLM's SamplingParams that we serve)."""

    max_tokens: int = 16  # new tokens to generate at most
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass in (0, 1]
    top_k: int = -1  # keep the k most likely tokens; -1 = all
    seed: int | None = None  # per-request RNG seed: same seed, same prompt -> same output
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the output)
    # extra stop tokens (kept in output ids); stored as a frozenset for O(1) per-token lookups
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False  # keep generating past the EOS token
    # return this many top logprobs per generated token (0 = chosen only)
    logprobs: int | None = None
    # return the logprob of every prompt token (given the tokens before it) and this many top
    # logprobs at each (0 = the prompt token's only; vLLM's prompt_logprobs)
    prompt_logprobs: int | None = None
    # the first prompt index whose logprob is wanted (earlier entries stay None); a scorer that
    # needs only a continuation's logprobs sets it to the context's length, so the prefix cache
    # may still serve the context's full blocks (runtime/engine/block_manager.py `_prefix_hits`)
    prompt_logprobs_start: int = 1
    # prefix-cache namespace (vLLM's cache_salt): requests share prefix blocks only when their
    # salts are equal (runtime/engine/block_manager.py), so tenants with different salts never do
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SamplingError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise SamplingError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k == 0 or self.top_k < -1:
            raise SamplingError("top_k", f"must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise SamplingError("logprobs", f"must be between 0 and 20, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and not (
            isinstance(self.prompt_logprobs, int) and 0 <= self.prompt_logprobs <= 20
        ):
            raise SamplingError(
                "prompt_logprobs", f"must be between 0 and 20, got {self.prompt_logprobs!r}"
            )
        if not isinstance(self.prompt_logprobs_start, int) or self.prompt_logprobs_start < 1:
            raise SamplingError(
                "prompt_logprobs_start",
                f"must be an integer >= 1, got {self.prompt_logprobs_start!r}",
            )
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError(
                "stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingError("stop", "stop strings must be non-empty strings")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise SamplingError(
                "stop",
                f"each stop string may have at most {MAX_STOP_STRING_CHARS} "
                f"characters, got one of {longest}",
            )
        self.stop_token_ids = frozenset(self.stop_token_ids)
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**64):
            raise SamplingError("seed", f"must be an integer in [0, 2^64), got {self.seed!r}")
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str)
            or not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
        ):
            raise SamplingError(
                "cache_salt",
                f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
            )

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 decode greedily (dividing by them overflows fp32 logits)."""
        return self.temperature < MIN_TEMPERATURE


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its KV freed; recomputed when rescheduled)
    RUNNING = "running"  # holds KV blocks and is scheduled every step
    FINISHED = "finished"  # done; see Sequence.finish_reason


@dataclass(eq=False)
class Sequence:
    """One request's tokens and KV-cache state. Mutated only by the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_id: int | None = None  # None: no EOS stop (or params.ignore_eos)
    arrival_time: float = field(default_factory=time.monotonic)  # s, monotonic clock
    output_token_ids: list[int] = field(default_factory=list)
    # per generated token: (chosen token logprob, {token id: logprob} of the top-n), if asked
    output_logprobs: list[tuple[float, dict[int, float]]] = field(default_factory=list)
    # per prompt token, the same, when params.prompt_logprobs is set (None before
    # prompt_logprobs_start and until computed); a recompute after preemption rewrites them
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)  # physical KV block ids, in order
    num_computed_tokens: int = 0  # leading tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, tokens served by the prefix cache (stats)
    num_preemptions: int = 0  # times its KV was dropped for recompute
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    first_token_time: float | None = None  # s, monotonic; for TTFT
    last_token_time: float | None = None  # s, monotonic; for inter-token latency
    finish_time: float | None = None  # s, monotonic
    # set when its prompt's KV was imported from a prefill replica (runtime/disagg/): a random
    # secret that salts its blocks' prefix-cache keys, so that no other request can hit them
    import_salt: bytes | None = None

    _all_ids: list[int] = field(default_factory=list, init=False, repr=False)  # see token_ids

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens: one list grown in place as outputs are appended (O(new
        tokens) per access, not a copy of the whole context every step). Read-only for callers."""
        ids, n_prompt = self._all_ids, len(self.prompt_token_ids)
        n = n_prompt + len(self.output_token_ids)
        if len(ids) != n:
            if len(ids) < n_prompt or len(ids) > n:  # first access (or outputs were replaced)
                ids[:] = self.prompt_token_ids
            ids.extend(self.output_token_ids[len(ids) - n_prompt :])
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def prompt_logprob_rows(self, start: int, n: int) -> range:
        """Positions among tokens[start : start + n] whose logits give prompt logprobs: p
        predicts prompt token p + 1, for p + 1 in [prompt_logprobs_start, num_prompt_tokens).
        Empty when the request asked for none."""
        if self.params.prompt_logprobs is None:
            return range(0)
        first = max(start, self.params.prompt_logprobs_start - 1)
        return range(first, min(start + n, self.num_prompt_tokens - 1))

    @property
    def prefix_salt(self) -> bytes | None:
        """What salts its prefix-cache keys (runtime/engine/block_manager.py): its cache_salt and its
        import salt, each length-prefixed so that no two different pairs encode alike; None
        when it has neither (the shared, unsalted namespace)."""
        if self.params.cache_salt is None and self.import_salt is None:
            return None
        parts = [
            b"" if self.params.cache_salt is None else self.params.cache_salt.encode(),
            self.import_salt or b"",
        ]
        return b"".join(struct.pack("<Q", len(p)) + p for p in parts)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while tokens other than the last sampled one still lack K/V (prompt or recompute)."""
        return self.num_tokens - self.num_computed_tokens > 1


@dataclass
class CompletionOutput:
    """What a request has produced: everything so far (the offline `LLM`), or only what is new
    since its previous output (`LLMEngine.output_deltas`, as the server receives it)."""

    index: int  # choice index (always 0: n > 1 is not served)
    text: str  # decoded text, stop string removed (a delta holds back a possible stop start)
    token_ids: list[int]  # generated token ids
    logprobs: list[tuple[float, dict[int, float]]] | None  # per token, if asked
    finish_reason: str | None  # None while running; "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    """One update for a request: the engine yields these while it runs (vLLM's RequestOutput)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    metrics: dict[str, float] = field(default_factory=dict)  # arrival, ttft_s, e2e_s, ...
    error: str | None = None  # set (with finish_reason "error") when this request failed alone
    # per prompt token (SamplingParams.prompt_logprobs): None before prompt_logprobs_start;
    # carried by every output once the prompt is computed
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None


class OutputAccumulator:
    """Delta outputs of one request in, one output holding all of them out (the latest one's
    status, metrics and error). Appends in place: O(total output), however many deltas."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None  # the latest delta added since the last take()
        self._text: list[str] = []
        self._ids: list[int] = []
        self._lps: list[tuple[float, dict[int, float]]] | None = None

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self._text.append(c.text)
        self._ids.extend(c.token_ids)
        if c.logprobs is not None:
            if self._lps is None:
                self._lps = []
            self._lps.extend(c.logprobs)
        self.last = out

    def take(self) -> RequestOutput | None:
        """Everything added since the previous take, as one output (None if nothing was)."""
        last = self.last
        if last is None:
            return None
        c = last.outputs[0]
        merged = RequestOutput(
            last.request_id,
            last.prompt_token_ids,
            [
                CompletionOutput(
                    c.index,
                    "".join(self._text),
                    self._ids,
                    self._lps,
                    c.finish_reason,
                    c.stop_reason,
                )
            ],
            last.finished,
            last.num_cached_tokens,
            last.metrics,
            last.error,
            last.prompt_logprobs,
        )
        self.last, self._text, self._ids, self._lps = None, [], [], None
        return merged
