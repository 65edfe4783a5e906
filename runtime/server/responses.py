"""The OpenAI response side: completion and chat bodies, SSE chunks, usage, logprobs.

The engine yields cumulative outputs; `DeltaTracker` turns them into the increments a stream
sends. While a request runs, a tail of the text that could be the start of a stop string is held
back (as vLLM does): the engine cuts a stop string only once it is complete, and text already
streamed cannot be taken back. The held-back length comes from a `StopPrefixMatcher` fed only
the text that is new since the previous chunk, so a long stop list costs each chunk time in
proportion to the new text, not to the whole output (runtime/stops.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slimserve.runtime.sequence import RequestOutput
from slimserve.runtime.stops import StopPrefixMatcher

DONE = "data: [DONE]\n\n"  # the OpenAI stream terminator


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(outs: list[RequestOutput]) -> dict[str, Any]:
    """One request's usage: the prompt once, the completion tokens of every choice (as OpenAI)."""
    prompt = len(outs[0].prompt_token_ids)
    completion = sum(len(out.outputs[0].token_ids) for out in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens}}


@dataclass
class Delta:
    """What a request produced since the previous delta."""

    text: str  # new text (stop string removed, possible stop-string start held back)
    token_ids: list[int]  # new token ids
    logprobs: list[tuple[float, dict[int, float]]] | None  # per new token, if asked
    finish_reason: str | None  # set on the last delta
    stop_reason: int | str | None


class DeltaTracker:
    """Cumulative RequestOutputs in, increments out (one tracker per request)."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = stop
        self.sent_chars = 0  # characters of the cumulative text already handed out
        self.sent_tokens = 0  # token ids already handed out
        self._matcher: StopPrefixMatcher | None = None  # built on the first running output
        self._fed = 0  # characters of the cumulative text given to the matcher

    def _held_back(self, text: str) -> int:
        """Trailing characters of the (growing) cumulative `text` that may begin a stop string."""
        if not self.stop:
            return 0
        if self._matcher is None:
            self._matcher = StopPrefixMatcher(self.stop)
        if len(text) < self._fed:  # the text shrank (never, for the engine): start over
            self._matcher.reset()
            self._fed = 0
        if len(text) > self._fed:
            self._matcher.feed(text[self._fed:])
            self._fed = len(text)
        return self._matcher.held

    def step(self, out: RequestOutput) -> Delta:
        c = out.outputs[0]
        end = len(c.text)
        if c.finish_reason is None:
            end -= self._held_back(c.text)
        end = max(end, self.sent_chars)
        text, self.sent_chars = c.text[self.sent_chars:end], end
        ids = c.token_ids[self.sent_tokens:]
        lps = c.logprobs[self.sent_tokens:] if c.logprobs is not None else None
        self.sent_tokens = len(c.token_ids)
        return Delta(text, ids, lps, c.finish_reason, c.stop_reason)


class _Format:
    """Shared envelope of one response: id, created, model, token strings, usage chunk."""

    object = ""  # OpenAI object name of a full response
    chunk_object = ""  # and of a stream chunk

    def __init__(self, request_id: str, model: str, created: int, tokenizer: Any, *,
                 logprobs: bool, include_usage: bool) -> None:
        self.id = request_id
        self.model = model
        self.created = created  # s since the epoch, as OpenAI
        self.tokenizer = tokenizer
        self.logprobs = logprobs  # whether choices carry logprobs
        self.include_usage = include_usage  # stream: usage null on chunks, then a usage chunk

    def token_str(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(self, outs: list[RequestOutput]) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage(outs)}


class CompletionFormat(_Format):
    """/v1/completions: `text` choices, legacy logprobs {tokens, token_logprobs, top_logprobs,
    text_offset}."""

    object = chunk_object = "text_completion"

    def __init__(self, *args: Any, echo: str = "", **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.echo = echo  # prompt text prepended to the output ("" = no echo)
        self.offsets: dict[int, int] = {}  # per choice: text_offset of its next token, characters

    def _lp(self, d: Delta, index: int) -> dict[str, Any] | None:
        if not self.logprobs or d.logprobs is None:
            return None
        tokens, offsets, tops = [], [], []
        for tid in d.token_ids:
            tokens.append(self.token_str(tid))
            offsets.append(self.offsets.get(index, len(self.echo)))
            self.offsets[index] = offsets[-1] + len(tokens[-1])
        for tid, (lp, top) in zip(d.token_ids, d.logprobs):
            # OpenAI always includes the sampled token, so up to logprobs + 1 entries
            tops.append({self.token_str(t): v for t, v in {**top, tid: lp}.items()})
        return {"tokens": tokens, "token_logprobs": [lp for lp, _ in d.logprobs],
                "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, text: str, d: Delta, index: int) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._lp(d, index),
                "finish_reason": d.finish_reason, "stop_reason": d.stop_reason}

    def opening(self, n: int = 1) -> list[dict[str, Any]]:
        """Chunks sent before any output: the echoed prompt of each choice, if asked."""
        if not self.echo:
            return []
        return [self.chunk_envelope([{"index": i, "text": self.echo, "logprobs": None,
                                      "finish_reason": None, "stop_reason": None}])
                for i in range(n)]

    def chunk(self, d: Delta, index: int = 0) -> dict[str, Any]:
        return self.chunk_envelope([self._choice(d.text, d, index)])

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            d = DeltaTracker([]).step(out)
            choices.append(self._choice(self.echo + d.text, d, i))
        return {**self._envelope(self.object, choices), "usage": usage(outs)}


class ChatFormat(_Format):
    """/v1/chat/completions: assistant message / delta choices, logprobs {content: [...]}."""

    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def _entry(self, token_id: int, lp: float) -> dict[str, Any]:
        s = self.token_str(token_id)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def _lp(self, d: Delta) -> dict[str, Any] | None:
        if not self.logprobs or d.logprobs is None:
            return None
        content = []
        for tid, (lp, top) in zip(d.token_ids, d.logprobs):
            entry = self._entry(tid, lp)
            entry["top_logprobs"] = [self._entry(t, v) for t, v in top.items()]
            content.append(entry)
        return {"content": content}

    def opening(self, n: int = 1) -> list[dict[str, Any]]:
        """OpenAI's first chunk of each choice announces the role with empty content."""
        return [self.chunk_envelope([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                for i in range(n)]

    def chunk(self, d: Delta, index: int = 0) -> dict[str, Any]:
        delta = {"content": d.text} if d.text else {}
        return self.chunk_envelope([{"index": index, "delta": delta, "logprobs": self._lp(d),
                                     "finish_reason": d.finish_reason,
                                     "stop_reason": d.stop_reason}])

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            d = DeltaTracker([]).step(out)
            choices.append({"index": i, "message": {"role": "assistant", "content": d.text},
                            "logprobs": self._lp(d), "finish_reason": d.finish_reason,
                            "stop_reason": d.stop_reason})
        return {**self._envelope(self.object, choices), "usage": usage(outs)}
