"""The OpenAI response side: completion and chat bodies, SSE chunks, usage, logprobs.

The engine hands the server deltas (only what is new per step), already safe to send: while a
request runs, the engine holds back a tail of the text that could be the start of a stop string
(runtime/engine/stops.py, `StopHoldBack`). A stream turns each delta into one chunk; a non-streamed
answer is built from the deltas merged (runtime/engine/sequence.py, `OutputAccumulator`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from slimserve.runtime.engine.sequence import RequestOutput

DONE = "data: [DONE]\n\n"  # the OpenAI stream terminator
LOGPROB_FLOOR = -9999.0  # what a logprob of -inf is sent as (JSON has no infinity)


def sse(obj: dict[str, Any]) -> str:
    """One server-sent event carrying a JSON object."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def usage(
    outs: list[RequestOutput], completion_tokens: list[int] | None = None, per_prompt: int = 0
) -> dict[str, Any]:
    """One request's usage: each prompt once, the completion tokens of every choice (as OpenAI).
    `outs` are whole outputs, or the last delta of each choice with `completion_tokens` counted.
    per_prompt: choices per prompt, when `outs` are several prompts' choices in prompt order
    (0: all are choices of one prompt)."""
    firsts = outs[::per_prompt] if per_prompt else outs[:1]
    prompt = sum(len(out.prompt_token_ids) for out in firsts)
    if completion_tokens is None:
        completion_tokens = [len(out.outputs[0].token_ids) for out in outs]
    completion = sum(completion_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(out.num_cached_tokens for out in firsts)},
    }


def _finite(lp: float) -> float:
    """A logprob JSON can carry: -inf becomes -9999.0, as vLLM and OpenAI send it."""
    return max(lp, LOGPROB_FLOOR)


@dataclass
class Delta:
    """What a request produced since the previous delta."""

    text: str  # new text (stop string removed, possible stop-string start held back)
    token_ids: list[int]  # new token ids
    logprobs: list[tuple[float, dict[int, float]]] | None  # per new token, if asked
    finish_reason: str | None  # set on the last delta
    stop_reason: int | str | None
    prompt_token_ids: list[int] = field(default_factory=list)  # the request's whole prompt
    # per prompt token, when asked (None at index 0 and before the engine computed them)
    prompt_logprobs: list[tuple[float, dict[int, float]] | None] | None = None


def delta(out: RequestOutput) -> Delta:
    """The Delta carried by one engine output (the engine sends deltas; see runtime/engine/llm_engine.py)."""
    c = out.outputs[0]
    return Delta(
        c.text,
        c.token_ids,
        c.logprobs,
        c.finish_reason,
        c.stop_reason,
        out.prompt_token_ids,
        out.prompt_logprobs,
    )


class _Format:
    """Shared envelope of one response: id, created, model, token strings, usage chunk."""

    object = ""  # OpenAI object name of a full response
    chunk_object = ""  # and of a stream chunk
    per_prompt = 0  # choices per prompt when a response holds several prompts (see usage)

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
        return {
            **self._envelope(self.chunk_object, []),
            "usage": usage(outs, completion_tokens, self.per_prompt),
        }

    def completion_tokens(self, d: Delta) -> int:
        """The tokens a delta adds to usage's completion_tokens."""
        return len(d.token_ids)


class CompletionFormat(_Format):
    """/v1/completions: `text` choices, legacy logprobs {tokens, token_logprobs, top_logprobs,
    text_offset}.

    Choices come in prompt order, `n` per prompt (choice index = prompt index x n + i, as
    vLLM). With echo, each choice's text starts with its prompt's text; with echo and logprobs
    its logprobs start with the prompt tokens (the first one's logprob and top_logprobs null,
    as vLLM's), which a stream sends in each choice's first chunk together with its first
    token. `hide_output` (max_tokens 0 with echo): the one token the engine generated is left
    out, so a choice is its prompt alone, finished by "length"."""

    object = chunk_object = "text_completion"

    def __init__(
        self,
        *args: Any,
        echo: str | list[str] | None = None,
        n: int = 1,
        top_logprobs: int = 0,
        prompt_logprobs: int | None = None,
        hide_output: bool = False,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        # per prompt, its text, prepended to its choices (None or "": no echo)
        self.echo = [echo] if isinstance(echo, str) else echo
        if not self.echo or self.echo == [""]:
            self.echo = None
        self.n = self.per_prompt = n  # choices per prompt
        self.top_logprobs = top_logprobs  # alternatives per prompt token in `logprobs`
        self.prompt_logprobs = prompt_logprobs  # the vLLM field asked (None: not sent)
        self.hide_output = hide_output
        self.offsets: dict[int, int] = {}  # per choice: text_offset of its next token, characters
        self.echoed: set[int] = set()  # choices whose stream has sent the prompt already
        self._strs: dict[int, str] = {}  # token strings decoded so far

    @property
    def echo_logprobs(self) -> bool:
        """Whether the prompt tokens' logprobs lead each choice's `logprobs`."""
        return self.logprobs and self.echo is not None

    def token_str(self, token_id: int) -> str:
        s = self._strs.get(token_id)
        if s is None:
            s = self._strs[token_id] = super().token_str(token_id)
        return s

    def _echo_of(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo else ""

    def _entries(
        self, ids: list[int], lps: list[tuple[float, dict[int, float]] | None], top_n: int | None
    ) -> tuple[list[float | None], list[dict[str, float] | None]]:
        """token_logprobs and top_logprobs of tokens: the best `top_n` alternatives of each
        (None: all the engine gave) and, as OpenAI, always the token itself."""
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        for tid, entry in zip(ids, lps):
            if entry is None:
                token_lps.append(None)
                tops.append(None)
                continue
            lp, top = entry
            best = list(top.items()) if top_n is None else list(top.items())[:top_n]
            token_lps.append(_finite(lp))
            tops.append({self.token_str(t): _finite(v) for t, v in {**dict(best), tid: lp}.items()})
        return token_lps, tops

    def _prompt_entries(self, d: Delta) -> list[tuple[float, dict[int, float]] | None]:
        plps = d.prompt_logprobs
        if plps is None:
            # ended before its prompt was computed, or a one-token prompt: its only entry is the
            # first token's, which has none (the engine computes no row for it)
            if d.finish_reason in ("abort", "error") or len(d.prompt_token_ids) <= 1:
                return [None] * len(d.prompt_token_ids)
            raise RuntimeError("the engine sent no prompt logprobs for an echo with logprobs")
        return plps

    def _lp(
        self, ids: list[int], lps: list[tuple[float, dict[int, float]] | None], index: int, top_n
    ) -> dict[str, Any]:
        tokens, offsets = [], []
        for tid in ids:
            tokens.append(self.token_str(tid))
            offsets.append(self.offsets.get(index, 0))
            self.offsets[index] = offsets[-1] + len(tokens[-1])
        token_lps, tops = self._entries(ids, lps, top_n)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _vllm_prompt_logprobs(self, d: Delta) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's `prompt_logprobs`: per prompt token None or {token id: {logprob, rank,
        decoded_token}}, the token itself and its `prompt_logprobs` best alternatives; rank is
        its place among them (1 = best), null for a token ranked below them all."""
        out: list[dict[str, dict[str, Any]] | None] = []
        for tid, entry in zip(d.prompt_token_ids, self._prompt_entries(d)):
            if entry is None:
                out.append(None)
                continue
            lp, top = entry
            ranked = list(top.items())[: self.prompt_logprobs]
            ranks = {t: r for r, (t, _) in enumerate(list(top.items()), 1)}
            item: dict[str, dict[str, Any]] = {
                str(tid): {
                    "logprob": _finite(lp),
                    "rank": ranks.get(tid),
                    "decoded_token": self.token_str(tid),
                }
            }
            for r, (t, v) in enumerate(ranked, 1):
                item.setdefault(
                    str(t), {"logprob": _finite(v), "rank": r, "decoded_token": self.token_str(t)}
                )
            out.append(item)
        return out

    def _choice(self, d: Delta, index: int, echo: bool) -> dict[str, Any]:
        """One choice (or one chunk of it): `echo` puts the prompt in front."""
        text, ids, lps = d.text, list(d.token_ids), d.logprobs
        finish, stop = d.finish_reason, d.stop_reason
        if self.hide_output:
            text, ids = "", []
            lps = None if lps is None else []
            if finish in ("stop", "length"):
                finish, stop = "length", None
        logprobs = None
        if self.logprobs and (lps is not None or echo):
            head = None
            if echo:  # the prompt first: its offsets start at 0, the generated ones follow
                pids = d.prompt_token_ids
                head = self._lp(pids, self._prompt_entries(d), index, self.top_logprobs)
            logprobs = self._lp(ids, lps or [], index, None)  # the engine gave `logprobs` each
            if head is not None:
                logprobs = {k: head[k] + logprobs[k] for k in head}
        choice = {
            "index": index,
            "text": (self._echo_of(index) if echo else "") + text,
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop,
        }
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(d)
        return choice

    def opening(self, n: int = 1) -> list[dict[str, Any]]:
        """Chunks sent before any output: the echoed prompt of each choice, when no logprobs
        go with it (else each choice's first chunk carries prompt and logprobs together)."""
        if self.echo is None or self.echo_logprobs:
            return []
        chunks = []
        for i in range(n):
            self.echoed.add(i)
            chunks.append(
                self.chunk_envelope(
                    [
                        {
                            "index": i,
                            "text": self._echo_of(i),
                            "logprobs": None,
                            "finish_reason": None,
                            "stop_reason": None,
                        }
                    ]
                )
            )
        return chunks

    def chunk(self, d: Delta, index: int = 0) -> dict[str, Any]:
        echo = bool(self.echo_logprobs and index not in self.echoed)
        self.echoed.add(index)
        return self.chunk_envelope([self._choice(d, index, echo)])

    def completion_tokens(self, d: Delta) -> int:
        return 0 if self.hide_output else len(d.token_ids)

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        echo = self.echo is not None
        choices = [self._choice(delta(out), i, echo) for i, out in enumerate(outs)]
        done = [0 if self.hide_output else len(out.outputs[0].token_ids) for out in outs]
        return {**self._envelope(self.object, choices), "usage": usage(outs, done, self.n)}


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
