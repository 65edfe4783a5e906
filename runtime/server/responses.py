"""The OpenAI response side: completion and chat bodies, SSE chunks, usage, logprobs.

The engine hands the server deltas (only what is new per step), already safe to send: while a
request runs, the engine holds back a tail of the text that could be the start of a stop string
(runtime/engine/stops.py, `StopHoldBack`). A stream turns each delta into one chunk; a non-streamed
answer is built from the deltas merged (runtime/engine/sequence.py, `OutputAccumulator`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slimserve.runtime.engine.sequence import RequestOutput

DONE = "data: [DONE]\n\n"  # the OpenAI stream terminator


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(outs: list[RequestOutput], completion_tokens: list[int] | None = None) -> dict[str, Any]:
    """One request's usage: the prompt once, the completion tokens of every choice (as OpenAI).
    `outs` are whole outputs, or the last delta of each choice with `completion_tokens` counted."""
    prompt = len(outs[0].prompt_token_ids)
    if completion_tokens is None:
        completion_tokens = [len(out.outputs[0].token_ids) for out in outs]
    completion = sum(completion_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": outs[0].num_cached_tokens},
    }


@dataclass
class Delta:
    """What a request produced since the previous delta."""

    text: str  # new text (stop string removed, possible stop-string start held back)
    token_ids: list[int]  # new token ids
    logprobs: list[tuple[float, dict[int, float]]] | None  # per new token, if asked
    finish_reason: str | None  # set on the last delta
    stop_reason: int | str | None


def delta(out: RequestOutput) -> Delta:
    """The Delta carried by one engine output (the engine sends deltas; see runtime/engine/llm_engine.py)."""
    c = out.outputs[0]
    return Delta(c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason)


class _Format:
    """Shared envelope of one response: id, created, model, token strings, usage chunk."""

    object = ""  # OpenAI object name of a full response
    chunk_object = ""  # and of a stream chunk

    def __init__(
        self,
        request_id: str,
        model: str,
        created: int,
        tokenizer: Any,
        *,
        logprobs: bool,
        include_usage: bool,
    ) -> None:
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
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        body = self._envelope(self.chunk_object, choices)
        if self.include_usage:
            body["usage"] = None
        return body

    def usage_chunk(
        self, outs: list[RequestOutput], completion_tokens: list[int]
    ) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object, []), "usage": usage(outs, completion_tokens)}


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
        return {
            "tokens": tokens,
            "token_logprobs": [lp for lp, _ in d.logprobs],
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _choice(self, text: str, d: Delta, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": self._lp(d, index),
            "finish_reason": d.finish_reason,
            "stop_reason": d.stop_reason,
        }

    def opening(self, n: int = 1) -> list[dict[str, Any]]:
        """Chunks sent before any output: the echoed prompt of each choice, if asked."""
        if not self.echo:
            return []
        return [
            self.chunk_envelope(
                [
                    {
                        "index": i,
                        "text": self.echo,
                        "logprobs": None,
                        "finish_reason": None,
                        "stop_reason": None,
                    }
                ]
            )
            for i in range(n)
        ]

    def chunk(self, d: Delta, index: int = 0) -> dict[str, Any]:
        return self.chunk_envelope([self._choice(d.text, d, index)])

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            d = delta(out)
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
        return [
            self.chunk_envelope(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for i in range(n)
        ]

    def chunk(self, d: Delta, index: int = 0) -> dict[str, Any]:
        delta = {"content": d.text} if d.text else {}
        return self.chunk_envelope(
            [
                {
                    "index": index,
                    "delta": delta,
                    "logprobs": self._lp(d),
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                }
            ]
        )

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            d = delta(out)
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": d.text},
                    "logprobs": self._lp(d),
                    "finish_reason": d.finish_reason,
                    "stop_reason": d.stop_reason,
                }
            )
        return {**self._envelope(self.object, choices), "usage": usage(outs)}
