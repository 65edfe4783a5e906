"""Sampler: next tokens from the logits of one step, per-request parameters and RNG streams.

Greedy rows take the argmax. Sampled rows apply temperature, then top-k, then top-p to the
logits and draw with the request's own torch.Generator (seeded from `seed`, else from the
engine seed and the request's arrival order), so a seeded request gives the same tokens whatever
else is in the batch. Logprobs are those of the raw model distribution (before temperature and
truncation), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimserve.runtime.sequence import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]  # one per row
    logprobs: list[tuple[float, dict[int, float]] | None]  # per row, when the request asked


def _truncate(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[V] logits with everything outside top-k and the top-p nucleus set to -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token)
        drop = (probs.cumsum(-1) - probs) >= top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> SampleResult:
    """logits fp32 [S, V] (one row per sampled sequence) -> tokens and optional logprobs."""
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    tokens = torch.empty(logits.shape[0], dtype=torch.long)
    if greedy_rows:
        tokens[greedy_rows] = logits[greedy_rows].argmax(-1).cpu()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = _truncate(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1).float().cpu()
        tokens[i] = torch.multinomial(probs, 1, generator=generators[i]).item()
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    logprobs: list[tuple[float, dict[int, float]] | None] = [None] * len(params)
    if want:
        lp = torch.log_softmax(logits[want].float(), -1).cpu()
        for j, i in enumerate(want):
            n = params[i].logprobs
            top = torch.topk(lp[j], n) if n else None
            tops = {int(t): float(v) for t, v in zip(top.indices, top.values)} if top is not None else {}
            logprobs[i] = (float(lp[j, tokens[i]]), tops)
    return SampleResult(tokens.tolist(), logprobs)
