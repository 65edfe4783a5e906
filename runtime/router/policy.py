"""Routing policies: which replica serves a request. Pure logic, no HTTP (runtime/router/app.py
proxies, runtime/router/replicas.py polls the replicas and keeps the state these functions read).

least-latency (the default) picks the replica with the smallest predicted time to first token,
from the load each replica reports on GET /state (runtime/engine/async_engine.py `EngineLoad`) and
what this router sent it since:

    new      = prompt tokens - tokens of its prefix this replica likely caches (prefix affinity);
               a text prompt's tokens are its characters / the replica's characters per token
    queued   = queued prefill tokens it last reported (tokens left to compute: less prefix-cache
               hits and chunks already computed), less what it has prefilled since that answer at
               the rate the cost below gives, + prefill tokens this router sent it after that poll
               was sent (no poll yet: the larger of the reported tokens and every prefill token it
               was sent that has no first token)
    decoding = sequences it reported decoding (at least this router's requests past prefill)
               + the requests sent after the poll (they decode while this one waits)
    context  = their tokens (what each decode step's attention reads)
    decode   = the step cost (runtime/stats/step_cost.py) of one step decoding `decoding` rows of
               `context` tokens
    work     = queued + new                                  (prefill tokens ahead of the first token)
    steps    = ceil(work / max(max_num_batched_tokens - decoding, 1))    (steps that prefill takes)
    ttft     = steps x decode + work x per_prefill_token
    ttft    *= 1 + KV_PRESSURE_WEIGHT x max(0, kv_cache_usage - KV_PRESSURE_FROM)

The step cost is the replica's own online fit: fixed, per prefill token, per decoding sequence,
per context token. Averages of recent step times lag behind a batch that fills up and, taken
per prefill step, are noisy enough to steer traffic on their own: a replica whose estimate came
out 4x too high was shunned while it sat idle. A replica that has not fit its cost yet is assumed
to cost the fleet's mean; an older server reporting only `step_time_s` and `prefill_s_per_token`
is modelled with those two. Polled state is up to one poll interval old; draining the reported
queue by what the replica has computed since, and adding what this router sent since, keeps a
burst between two polls from piling onto the replica that looked idlest at the last one. Ties
(equal predictions: idle replicas) go to fewer requests in flight from this router, then to the
one sent fewer requests so far, then registration order.

Prefix affinity (as SGLang's cache-aware router): the first MAX_CHUNKS chunks of the prompt
(CHUNK_CHARS characters of text, CHUNK_TOKENS ids of a token-id prompt) are hashed cumulatively
(hash i covers chunks 0..i); each replica remembers the hashes of the prompts it was sent in a
bounded LRU; a prompt whose first k chunk hashes a replica holds is assumed to find that many
chunks in its prefix cache. With equal loads the replica holding the prefix wins; a loaded one
loses it once its queue costs more than the prefix saves.

Disaggregated replicas (runtime/disagg/): the prefill replica is chosen by `choose` among the
prefill replicas (the model above is exactly a prefill's cost), the decode replica by
`choose_decode` among the decode replicas: least-latency takes the one with the fewest running
sequences (each step's time grows with its batch), a nearly full KV cache last; round-robin and
random cycle / draw over them.
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from slimserve.runtime.stats.step_cost import FIELDS, StepCost

CHUNK_CHARS = 256  # characters per hashed chunk of a text prompt
CHUNK_TOKENS = 64  # ids per hashed chunk of a token-id prompt
MAX_CHUNKS = 4  # chunks hashed per prompt (the prefix affinity looks this far)
CHARS_PER_TOKEN = 4.0  # a text prompt's characters per token until the replica reports its own
PREFIX_LRU_SIZE = 8192  # chunk hashes remembered per replica
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4  # until a replica has measured its own (or the fleet's mean)
DEFAULT_STEP_TIME_S = 0.02
DEFAULT_COST = StepCost(DEFAULT_STEP_TIME_S, DEFAULT_PREFILL_S_PER_TOKEN)
DEFAULT_MAX_BATCHED_TOKENS = 2048
KV_PRESSURE_FROM = 0.9  # KV-cache usage above which a replica's prediction is inflated
KV_PRESSURE_WEIGHT = 20.0  # x(1 + 20 x 0.1) = 3x at a full cache: preemption and waiting ahead

POLICIES = ("least-latency", "round-robin", "random")


@dataclass(frozen=True)
class PromptInfo:
    """What the policy knows of a request's prompt."""

    tokens: int  # prompt tokens: exact for token ids, at CHARS_PER_TOKEN for text
    prefix_hashes: tuple[bytes, ...] = ()  # cumulative hashes of its first full chunks
    tokens_per_chunk: float = CHUNK_CHARS / CHARS_PER_TOKEN
    chars: int | None = None  # a text prompt's characters (its tokens depend on the tokenizer)


def _hashes(parts: Sequence[bytes]) -> tuple[bytes, ...]:
    h, out = hashlib.blake2b(digest_size=16), []
    for part in parts:
        h.update(part)
        out.append(h.copy().digest())
    return tuple(out)


def text_prompt(text: str) -> PromptInfo:
    chunks = [
        text[i : i + CHUNK_CHARS].encode("utf-8", "surrogatepass")
        for i in range(0, min(len(text), CHUNK_CHARS * MAX_CHUNKS), CHUNK_CHARS)
    ]
    full = [c for i, c in enumerate(chunks) if (i + 1) * CHUNK_CHARS <= len(text)]
    return PromptInfo(
        max(1, round(len(text) / CHARS_PER_TOKEN)),
        _hashes(full),
        CHUNK_CHARS / CHARS_PER_TOKEN,
        len(text),
    )


def ids_prompt(ids: Sequence[int]) -> PromptInfo:
    full = [
        ",".join(map(str, ids[i : i + CHUNK_TOKENS])).encode()
        for i in range(0, min(len(ids), CHUNK_TOKENS * MAX_CHUNKS), CHUNK_TOKENS)
        if i + CHUNK_TOKENS <= len(ids)
    ]
    return PromptInfo(
        max(1, len(ids)),
        _hashes([b"ids:" + full[0]] + full[1:]) if full else (),
        float(CHUNK_TOKENS),
    )


def prompt_info(body: Any, chat: bool) -> PromptInfo:
    """The prompt of a parsed request body (anything: the replica validates it, not us)."""
    if not isinstance(body, dict):
        return PromptInfo(1)
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return PromptInfo(1)
        parts = []
        for m in messages:
            if not isinstance(m, dict):
                continue
            content = m.get("content")
            if isinstance(content, list):  # content parts: their text
                content = "".join(
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
            parts.append(f"<{m.get('role')}>{content if isinstance(content, str) else ''}")
        return text_prompt("".join(parts))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return text_prompt(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return ids_prompt(prompt)
    return PromptInfo(1)


class PrefixIndex:
    """Bounded LRU of the chunk hashes of prompts sent to one replica."""

    def __init__(self, capacity: int = PREFIX_LRU_SIZE) -> None:
        self.capacity = capacity
        self._lru: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def match(self, hashes: Sequence[bytes]) -> int:
        """How many leading chunks of the prompt this replica was sent before."""
        for k in range(len(hashes), 0, -1):
            if hashes[k - 1] in self._lru:
                return k
        return 0

    def insert(self, hashes: Sequence[bytes]) -> None:
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)


@dataclass
class ReplicaState:
    """One replica as the policy sees it: the last polled load and this router's own counters."""

    url: str
    up: bool = True
    role: str = "colocated"  # polled: colocated | prefill | decode (runtime/disagg/protocol.py)
    kv_host: str | None = None  # polled: equal for replicas sharing KV segment memory (one host)
    # polled (GET /state of runtime/server/app.py); None: not reported
    queued_prefill_tokens: int = 0
    num_running: int = 0
    num_decoding: int = 0
    decoding_context_tokens: int = 0
    kv_cache_usage: float = 0.0
    step_cost: StepCost | None = None
    step_time_s: float | None = None  # an older server's two numbers, when it reports no step_cost
    prefill_s_per_token: float | None = None
    chars_per_token: float | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    answered_at: float | None = None  # monotonic s the last /state answer arrived
    # this router's, updated at every dispatch / first token / end
    inflight: int = 0  # requests sent and not finished
    inflight_prefill_tokens: int = 0  # prompt tokens (less the expected cached prefix) sent
    polled: bool = False  # queued_prefill_tokens came from a GET /state
    prefill_sent_since_poll: int = 0  # of inflight_prefill_tokens, those sent after that poll
    prefills_sent_since_poll: int = 0  # the requests they belong to
    inflight_prefilling: int = 0  # of `inflight`, those without a first token yet
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    dispatched: int = 0  # requests sent in all


def prompt_tokens(replica: ReplicaState, prompt: PromptInfo) -> float:
    """The prompt's tokens in the replica's tokenizer, as far as the router can tell."""
    if prompt.chars is None or not replica.chars_per_token:
        return float(prompt.tokens)
    return max(1.0, prompt.chars / replica.chars_per_token)


def cached_tokens(replica: ReplicaState, prompt: PromptInfo) -> int:
    """Tokens of the prompt the replica likely holds in its prefix cache (never all of it)."""
    per_chunk = (
        prompt.tokens_per_chunk
        if prompt.chars is None or not replica.chars_per_token
        else CHUNK_CHARS / replica.chars_per_token
    )
    held = replica.prefixes.match(prompt.prefix_hashes) * per_chunk
    return int(min(held, prompt_tokens(replica, prompt) - 1))


def new_tokens(replica: ReplicaState, prompt: PromptInfo) -> int:
    """Prompt tokens the replica has to compute: less the prefix it likely caches."""
    return max(1, round(prompt_tokens(replica, prompt)) - cached_tokens(replica, prompt))


def reported_cost(replica: ReplicaState) -> StepCost | None:
    """The replica's step cost: its fit, or an older server's step time and prefill cost."""
    if replica.step_cost is not None:
        return replica.step_cost
    if replica.step_time_s or replica.prefill_s_per_token:
        return StepCost(
            replica.step_time_s or DEFAULT_STEP_TIME_S,
            replica.prefill_s_per_token or DEFAULT_PREFILL_S_PER_TOKEN,
        )
    return None


def fleet_cost(replicas: Sequence[ReplicaState]) -> StepCost:
    """The mean of the costs the replicas report: what one that has not measured itself costs."""
    costs = [c for c in map(reported_cost, replicas) if c is not None]
    if not costs:
        return DEFAULT_COST
    return StepCost(*(sum(getattr(c, f) for c in costs) / len(costs) for f in FIELDS))


def predicted_ttft(
    replica: ReplicaState,
    prompt: PromptInfo,
    default_cost: StepCost = DEFAULT_COST,
    now: float | None = None,
) -> float:
    """Seconds until this request's first token on `replica` (the model in the module doc)."""
    cost = reported_cost(replica) or default_cost
    budget = replica.max_num_batched_tokens
    router_decoding = replica.inflight - replica.inflight_prefilling
    decoding, context = replica.num_decoding, float(replica.decoding_context_tokens)
    if router_decoding > decoding:  # more than it reported: at its mean context each
        context += (router_decoding - decoding) * (context / decoding if decoding else 0.0)
        decoding = router_decoding
    if replica.polled:
        queued = float(replica.queued_prefill_tokens)
        if queued and replica.answered_at is not None:  # prefilled since it answered
            now = time.monotonic() if now is None else now
            chunk = max(budget - decoding, 1)
            rate = chunk / cost.step_s(chunk, decoding, context)
            queued = max(0.0, queued - max(0.0, now - replica.answered_at) * rate)
        queued += replica.prefill_sent_since_poll
        decoding += replica.prefills_sent_since_poll
        context += replica.prefill_sent_since_poll
    else:
        queued = float(max(replica.queued_prefill_tokens, replica.inflight_prefill_tokens))
    work = queued + new_tokens(replica, prompt)
    steps = math.ceil(work / max(budget - decoding, 1))
    ttft = steps * cost.step_s(0, decoding, context) + work * cost.per_prefill_token_s
    return ttft * (1 + KV_PRESSURE_WEIGHT * max(0.0, replica.kv_cache_usage - KV_PRESSURE_FROM))


class Policy:
    name = ""

    def choose(self, replicas: Sequence[ReplicaState], prompt: PromptInfo) -> ReplicaState | None:
        """The replica to send `prompt` to, among those up; None when none is."""
        raise NotImplementedError

    def choose_decode(self, replicas: Sequence[ReplicaState]) -> ReplicaState | None:
        """The decode replica to continue a prefilled request on, among those up."""
        return self.choose(replicas, PromptInfo(1))


class LeastLatency(Policy):
    name = "least-latency"

    def choose(self, replicas: Sequence[ReplicaState], prompt: PromptInfo) -> ReplicaState | None:
        up = [r for r in replicas if r.up]
        if not up:
            return None
        # a replica that has not measured itself yet is assumed to be as fast as the others
        default, now = fleet_cost(up), time.monotonic()
        order = {id(r): i for i, r in enumerate(up)}
        return min(
            up,
            key=lambda r: (
                predicted_ttft(r, prompt, default, now),
                r.inflight,
                r.dispatched,
                order[id(r)],
            ),
        )

    def choose_decode(self, replicas: Sequence[ReplicaState]) -> ReplicaState | None:
        up = [r for r in replicas if r.up]
        if not up:
            return None
        order = {id(r): i for i, r in enumerate(up)}
        return min(
            up,
            key=lambda r: (
                r.kv_cache_usage > KV_PRESSURE_FROM,
                max(r.num_running, r.inflight),
                r.kv_cache_usage,
                r.dispatched,
                order[id(r)],
            ),
        )


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0
        self._next_decode = 0

    def _cycle(
        self, replicas: Sequence[ReplicaState], start: int
    ) -> tuple[ReplicaState | None, int]:
        n = len(replicas)
        for k in range(n):
            r = replicas[(start + k) % n]
            if r.up:
                return r, (start + k + 1) % n
        return None, start

    def choose(self, replicas: Sequence[ReplicaState], prompt: PromptInfo) -> ReplicaState | None:
        r, self._next = self._cycle(replicas, self._next)
        return r

    def choose_decode(self, replicas: Sequence[ReplicaState]) -> ReplicaState | None:
        r, self._next_decode = self._cycle(replicas, self._next_decode)
        return r


class Random(Policy):
    name = "random"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, replicas: Sequence[ReplicaState], prompt: PromptInfo) -> ReplicaState | None:
        up = [r for r in replicas if r.up]
        return self._rng.choice(up) if up else None


def make_policy(name: str) -> Policy:
    if name == "least-latency":
        return LeastLatency()
    if name == "round-robin":
        return RoundRobin()
    if name == "random":
        return Random()
    raise ValueError(f"unknown routing policy {name!r}; choose one of {', '.join(POLICIES)}")
