"""A fake AsyncEngine for the server tests (the interface it imitates: docs/architecture.md,
"The engine interface the server uses").

The fake generates one character per step ("a", "b", "c", ... shifted by the seed) after a
small delay, so every answer is known in advance and the tests need no model. Like the real
engine it yields deltas, holding back text that may begin a stop string (runtime/engine/stops.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

from slimserve.runtime.engine.async_engine import EngineLoad
from slimserve.runtime.engine.sequence import CompletionOutput, RequestOutput, SamplingParams
from slimserve.runtime.engine.stops import StopHoldBack
from slimserve.runtime.errors import EngineDeadError, RequestError
from slimserve.runtime.stats.profiler import ProfilingDisabled
from slimserve.runtime.stats.rank_stats import RankStats
from slimserve.runtime.stats.step_timing import StepTimings

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"


@dataclass
class FakeStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.25
    prefix_cache_hit_rate: float = 0.5
    num_preemptions: int = 3
    num_blocks: int = 64
    block_size: int = 16
    capacity_tokens: int = 1024
    cpu_threads: int = 2
    cpu_thread_changes: int = 1


class FakeTokenizer:
    """One token per character (token id = code point); renders TEMPLATE-shaped chat prompts."""

    eos_token_id = 0

    def __init__(self, chat_template: str | None = TEMPLATE):
        self.chat_template = chat_template

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt
        if any(m["content"] == "REJECT" for m in messages):
            raise ValueError("Conversation roles must alternate user/assistant")
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class FakeEngine:
    """The AsyncEngine interface, deterministic: step i yields chr(ord('a') + (i + seed) % 26)."""

    def __init__(self, delay: float = 0.002, max_model_len: int = 64, chat_template=TEMPLATE):
        self.model_name = "fake-model"
        self.tokenizer = FakeTokenizer(chat_template)
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_model_len  # FakeTokenizer: one token per character
        self.unhealthy: str | None = None  # health_problem() answer besides a dead engine
        self.fail_request_after: int | None = None  # the request fails alone after this many tokens
        self.delay = delay  # s per generated token
        self.started = self.shut_down = False
        self.dead = False  # generate/stats raise EngineDeadError
        self.die_after: int | None = None  # raise EngineDeadError after this many tokens
        self.fail_with: Exception | None = None  # generate raises this (an engine bug)
        self.requests: list[tuple[str, list[int], SamplingParams]] = []
        self.abort_calls: list[str] = []  # engine.abort(request_id) calls
        self.prefix_cache_resets = 0  # reset_prefix_cache() calls
        self.closed_early: list[str] = []  # generators the consumer left before the end
        self.waiting = 0
        self._aborts: dict[str, asyncio.Event] = {}
        self._prefill: dict[str, int] = {}  # request id -> prompt tokens, until its first token

    def startup_line(self) -> str:
        return "load 0.00 s, total 0.0 s"

    def kv_capacity_line(self) -> str:
        return "KV cache: float32, 64 blocks of 16 tokens (fake)"

    async def start(self):
        self.started = True

    async def shutdown(self):
        self.shut_down = True

    def stats(self):
        if self.dead:
            raise EngineDeadError("fake engine died")
        return FakeStats(num_running=len(self._aborts), num_waiting=self.waiting)

    def load(self):
        return EngineLoad(
            sum(self._prefill.values()), 64, len(self.requests), step_time_s=self.delay
        )

    def health_problem(self):
        return "fake engine died" if self.dead else self.unhealthy

    def step_timing(self):
        return StepTimings().snapshot()  # no steps: the step histograms render empty

    def rank_stats(self):
        """One process: rank 0's memory, no collectives."""
        return [
            RankStats(
                0,
                weight_bytes=2**20,
                kv_cache_bytes=2**19,
                memory_bytes=2**26,
                comm_seconds=None,
                comm_calls=None,
            )
        ]

    async def reset_prefix_cache(self):
        if self.dead:
            raise EngineDeadError("fake engine died")
        self.prefix_cache_resets += 1

    async def start_profile(self, record_shapes=False, max_steps=None):
        raise ProfilingDisabled("profiling is off: start the server with --profile-dir DIR")

    async def stop_profile(self):
        raise ProfilingDisabled("profiling is off: start the server with --profile-dir DIR")

    def abort(self, request_id):
        self.abort_calls.append(request_id)
        if request_id in self._aborts:
            self._aborts[request_id].set()

    def _output(self, rid, prompt, ids, text, lps, reason, stop, t, error=None) -> RequestOutput:
        return RequestOutput(
            rid,
            prompt,
            [CompletionOutput(0, text, list(ids), lps and list(lps), reason, stop)],
            reason is not None,
            metrics=t,
            error=error,
        )

    async def generate(self, prompt, params, request_id):
        if self.dead:
            raise EngineDeadError("fake engine died")
        if self.fail_with is not None:
            raise self.fail_with
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise RequestError("prompt", "is empty; send at least one token")
        if len(ids) >= self.max_model_len:
            raise RequestError("prompt", f"has {len(ids)} tokens; limit {self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError("max_tokens", f"ask for at most {self.max_model_len - len(ids)}")
        self.requests.append((request_id, ids, params))
        aborted = self._aborts[request_id] = asyncio.Event()
        self._prefill[request_id] = len(ids)
        t = {"arrival": time.monotonic()}
        out_ids, lps, finished = [], [] if params.logprobs is not None else None, False
        hold, sent = StopHoldBack(params.stop), 0  # sent: token ids handed out so far

        def delta(text, reason, stop=None, error=None):
            nonlocal sent
            d = self._output(
                request_id,
                ids,
                out_ids[sent:],
                hold.take(text, reason is not None),
                lps[sent:] if lps is not None else None,
                reason,
                stop,
                t,
                error,
            )
            sent = len(out_ids)
            return d

        try:
            for i in range(params.max_tokens):
                try:
                    await asyncio.wait_for(aborted.wait(), self.delay)
                    finished = True
                    yield delta(self.tokenizer.decode(out_ids), "abort")
                    return
                except asyncio.TimeoutError:
                    pass
                if self.die_after is not None and i >= self.die_after:
                    raise EngineDeadError("fake engine died mid-request")
                self._prefill.pop(request_id, None)
                tok = ord("a") + (i + (params.seed or 0)) % 26
                out_ids.append(tok)
                if lps is not None:
                    top = {tok: -0.5, tok + 1: -1.5, tok + 2: -2.5}
                    lps.append((-0.5, dict(list(top.items())[: params.logprobs])))
                if self.fail_request_after is not None and i >= self.fail_request_after:
                    finished = True
                    yield delta(self.tokenizer.decode(out_ids), "error", error="logits are NaN")
                    return
                t.setdefault("first_token", time.monotonic())
                t["last_token"] = time.monotonic()
                text, reason, stop = self.tokenizer.decode(out_ids), None, None
                hits = [(text.find(s), s) for s in params.stop if s in text]
                if hits:
                    cut, stop = min(hits)
                    text, reason = text[:cut], "stop"
                elif tok in params.stop_token_ids:
                    reason, stop = "stop", tok
                elif i == params.max_tokens - 1:
                    reason = "length"
                if reason:
                    t["finish"] = time.monotonic()
                    finished = True
                yield delta(text, reason, stop)
                if finished:
                    return
        finally:
            self._aborts.pop(request_id, None)
            self._prefill.pop(request_id, None)
            if not finished:
                self.closed_early.append(request_id)


def events(text: str) -> list:
    """The JSON objects of an SSE body, and the final '[DONE]' as a string."""
    out = []
    for block in text.strip().split("\n\n"):
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def chat_messages(content="hi"):
    return [{"role": "user", "content": content}]
