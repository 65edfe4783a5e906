"""Routing policies: which replica serves a request. Pure logic, no HTTP (runtime/router/app.py
proxies, runtime/router/replicas.py polls the replicas and keeps the state these functions read).

least-latency (the default) picks the replica with the smallest predicted time to first token:

    new     = prompt tokens - tokens of its prefix this replica likely caches (prefix affinity)
    queued  = queued prefill tokens the replica last reported (tokens left to compute: less its
              prefix-cache hits and the chunks already computed) + prefill tokens this router
              sent it after that poll was sent (no poll yet: the larger of the reported tokens
              and every prefill token it was sent that has no first token)
    running = max(sequences the replica reported running, this router's requests past prefill)
    work    = queued + new                                   (prefill tokens ahead of the first token)
    steps   = 1 + work // max(max_num_batched_tokens - running, 1)     (steps that prefill takes)
    ttft    = work x prefill_s_per_token + steps x step_time_s
    ttft   *= 1 + KV_PRESSURE_WEIGHT x max(0, kv_cache_usage - KV_PRESSURE_FROM)

`prefill_s_per_token` and `step_time_s` are the replica's own moving averages (GET /state,
runtime/async_engine.py `EngineLoad`), fleet defaults until it has measured them. The polled
state is at most one poll interval old; the router adds what it sent since, so a burst between
two polls spreads out instead of piling onto the replica that looked idlest at the last poll,
and traffic that reaches a replica from elsewhere still counts. (It used to take the max of the
poll and every prompt it had sent without a first token: a long prompt then counted whole until
its first token, however much of it chunked prefill had computed, and a cached prefix counted
too, so a replica prefilling a long prompt or holding the shared prefix looked busier than it
was and least-latency piled the short requests onto the other one.) Ties (equal predictions: idle replicas) go to fewer requests in
flight from this router, then to the one sent fewer requests so far, then registration order.

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
import random
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Sequence

CHUNK_CHARS = 256  # characters per hashed chunk of a text prompt
CHUNK_TOKENS = 64  # ids per hashed chunk of a token-id prompt
MAX_CHUNKS = 4  # chunks hashed per prompt (the prefix affinity looks this far)
CHARS_PER_TOKEN = 4.0  # estimate of a text prompt's tokens (the router has no tokenizer)
PREFIX_LRU_SIZE = 8192  # chunk hashes remembered per replica
DEFAULT_PREFILL_S_PER_TOKEN = 1e-4  # until a replica has measured its own (or the fleet's mean)
DEFAULT_STEP_TIME_S = 0.02
DEFAULT_MAX_BATCHED_TOKENS = 2048
KV_PRESSURE_FROM = 0.9  # KV-cache usage above which a replica's prediction is inflated
KV_PRESSURE_WEIGHT = 20.0  # x(1 + 20 x 0.1) = 3x at a full cache: preemption and waiting ahead

POLICIES = ("least-latency", "round-robin", "random")


@dataclass(frozen=True)
class PromptInfo:
    """What the policy knows of a request's prompt."""

    tokens: int  # estimated prompt tokens
    prefix_hashes: tuple[bytes, ...] = ()  # cumulative hashes of its first full chunks
    tokens_per_chunk: float = CHUNK_CHARS / CHARS_PER_TOKEN


def _hashes(parts: Sequence[bytes]) -> tuple[bytes, ...]:
    h, out = hashlib.blake2b(digest_size=16), []
    for part in parts:
        h.update(part)
        out.append(h.copy().digest())
    return tuple(out)


def text_prompt(text: str) -> PromptInfo:
    chunks = [text[i: i + CHUNK_CHARS].encode("utf-8", "surrogatepass")
              for i in range(0, min(len(text), CHUNK_CHARS * MAX_CHUNKS), CHUNK_CHARS)]
    full = [c for i, c in enumerate(chunks) if (i + 1) * CHUNK_CHARS <= len(text)]
    return PromptInfo(max(1, round(len(text) / CHARS_PER_TOKEN)), _hashes(full),
                      CHUNK_CHARS / CHARS_PER_TOKEN)


def ids_prompt(ids: Sequence[int]) -> PromptInfo:
    full = [",".join(map(str, ids[i: i + CHUNK_TOKENS])).encode()
            for i in range(0, min(len(ids), CHUNK_TOKENS * MAX_CHUNKS), CHUNK_TOKENS)
            if i + CHUNK_TOKENS <= len(ids)]
    return PromptInfo(max(1, len(ids)), _hashes([b"ids:" + full[0]] + full[1:]) if full else (),
                      float(CHUNK_TOKENS))


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
                content = "".join(p.get("text", "") for p in content
                                  if isinstance(p, dict) and isinstance(p.get("text"), str))
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
    # polled (GET /state of runtime/server/app.py); None: not reported
    queued_prefill_tokens: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    step_time_s: float | None = None
    prefill_s_per_token: float | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_BATCHED_TOKENS
    # this router's, updated at every dispatch / first token / end
    inflight: int = 0  # requests sent and not finished
    inflight_prefill_tokens: int = 0  # prompt tokens (less the expected cached prefix) sent
    polled: bool = False  # queued_prefill_tokens came from a GET /state
    prefill_sent_since_poll: int = 0  # of inflight_prefill_tokens, those sent after that poll
    inflight_prefilling: int = 0  # of `inflight`, those without a first token yet
    prefixes: PrefixIndex = field(default_factory=PrefixIndex)
    dispatched: int = 0  # requests sent in all


def cached_tokens(replica: ReplicaState, prompt: PromptInfo) -> int:
    """Tokens of the prompt the replica likely holds in its prefix cache (never all of it)."""
    held = replica.prefixes.match(prompt.prefix_hashes) * prompt.tokens_per_chunk
    return int(min(held, prompt.tokens - 1))


def predicted_ttft(replica: ReplicaState, prompt: PromptInfo,
                   default_prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN,
                   default_step_time_s: float = DEFAULT_STEP_TIME_S) -> float:
    """Seconds until this request's first token on `replica` (the model in the module doc)."""
    per_token = replica.prefill_s_per_token or default_prefill_s_per_token
    step = replica.step_time_s or default_step_time_s
    new = max(1, prompt.tokens - cached_tokens(replica, prompt))
    queued = replica.queued_prefill_tokens + replica.prefill_sent_since_poll if replica.polled \
        else max(replica.queued_prefill_tokens, replica.inflight_prefill_tokens)
    running = max(replica.num_running, replica.inflight - replica.inflight_prefilling)
    work = queued + new
    steps = 1 + work // max(replica.max_num_batched_tokens - running, 1)
    ttft = work * per_token + steps * step
    return ttft * (1 + KV_PRESSURE_WEIGHT * max(0.0, replica.kv_cache_usage - KV_PRESSURE_FROM))


def _mean(values: list[float], default: float) -> float:
    return sum(values) / len(values) if values else default


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
        per_token = _mean([r.prefill_s_per_token for r in up if r.prefill_s_per_token],
                          DEFAULT_PREFILL_S_PER_TOKEN)
        step = _mean([r.step_time_s for r in up if r.step_time_s], DEFAULT_STEP_TIME_S)
        order = {id(r): i for i, r in enumerate(up)}
        return min(up, key=lambda r: (predicted_ttft(r, prompt, per_token, step), r.inflight,
                                      r.dispatched, order[id(r)]))

    def choose_decode(self, replicas: Sequence[ReplicaState]) -> ReplicaState | None:
        up = [r for r in replicas if r.up]
        if not up:
            return None
        order = {id(r): i for i, r in enumerate(up)}
        return min(up, key=lambda r: (r.kv_cache_usage > KV_PRESSURE_FROM,
                                      max(r.num_running, r.inflight), r.kv_cache_usage,
                                      r.dispatched, order[id(r)]))


class RoundRobin(Policy):
    name = "round-robin"

    def __init__(self) -> None:
        self._next = 0
        self._next_decode = 0

    def _cycle(self, replicas: Sequence[ReplicaState], start: int) -> tuple[ReplicaState | None, int]:
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
