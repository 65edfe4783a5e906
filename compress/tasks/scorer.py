"""Log-likelihood scoring of multiple-choice items on our own engine (runtime/llm.py).

Each choice of an item is one request: the context and continuation tokens as the prompt, with
the logprobs of the continuation's tokens asked for (SamplingParams.prompt_logprobs from the
continuation's first index). Tokenization follows lm-evaluation-harness 0.4.x so that the two
score the same tokens: trailing spaces of the context move to the continuation, the whole string
and the context are encoded without special tokens, and the continuation is the whole
encoding past the context's length (an empty context becomes the end-of-text token); a prompt
longer than the model's context is cut on the left, as lm-eval does.

The choices of an item share their context. Items go in rounds: first each item's shared token
prefix (when it spans at least one full KV block and the item has more than one choice) is
prefilled once, which leaves its full blocks in the prefix cache; then every choice runs and
computes only from the last cached block on (runtime/engine/block_manager.py: a request with
prompt logprobs from index s may take cached blocks up to position s - 1). Within a round all
requests are batched by the engine's scheduler through the paged KV cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from slimserve.runtime.engine.sequence import SamplingParams


@dataclass(frozen=True, slots=True)
class ChoiceScore:
    """One choice's log-likelihood: the sum over its continuation tokens, whether every one of
    them is the model's argmax (lm-eval's is_greedy), and how many tokens it has."""

    logprob: float
    greedy: bool
    tokens: int


@dataclass(frozen=True, slots=True)
class Encoded:
    """A choice as token ids: the prompt (context then continuation) and where the continuation
    starts in it."""

    ids: list[int]
    start: int


def encode_pair(tokenizer, context: str, continuation: str, max_len: int) -> Encoded:
    """lm-eval's context/continuation split (see the module docstring), the prompt at most
    `max_len` tokens (cut on the left, the continuation kept whole when it fits)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    if context:
        whole = tokenizer.encode(context + continuation, add_special_tokens=False)
        ctx = tokenizer.encode(context, add_special_tokens=False)
        start = len(ctx)
    else:
        eot = tokenizer.eos_token_id
        if eot is None:
            raise ValueError("an empty context needs the tokenizer's end-of-text token")
        whole = [eot] + tokenizer.encode(continuation, add_special_tokens=False)
        start = 1
    if start >= len(whole):
        raise ValueError(f"continuation {continuation!r} encodes to no tokens")
    if len(whole) > max_len:
        cut = len(whole) - max_len
        if cut >= start:
            raise ValueError(
                f"continuation {continuation[:40]!r}... has {len(whole) - start} tokens, "
                f"more than the model's context of {max_len}"
            )
        whole, start = whole[cut:], start - cut
    return Encoded(whole, start)


def shared_prefix(choices: Sequence[Encoded]) -> int:
    """Tokens every choice's prompt starts with, up to the earliest continuation start."""
    n = min(c.start for c in choices)
    first = choices[0].ids
    for c in choices[1:]:
        i = 0
        while i < n and c.ids[i] == first[i]:
            i += 1
        n = i
    return n


def score_items(
    llm,
    items: Sequence[tuple[Sequence[str], Sequence[str]]],
    *,
    round_items: int = 64,
    on_progress: Callable[[int], None] | None = None,
) -> list[list[ChoiceScore]]:
    """Per item (its per-choice contexts, its per-choice continuations), one ChoiceScore per
    choice. `llm` is a runtime LLM; on_progress(n) is called after each round with the items
    done so far."""
    tok = llm.get_tokenizer()
    if tok is None:
        raise ValueError("the model has no tokenizer; task scoring needs one")
    # the prompt plus the one token each request generates must fit the context
    max_len = llm.engine.max_model_len - 1
    block = llm.engine.block_manager.block_size
    encoded = [
        [encode_pair(tok, c, x, max_len) for c, x in zip(contexts, continuations)]
        for contexts, continuations in items
    ]
    out: list[list[ChoiceScore]] = []
    for lo in range(0, len(encoded), round_items):
        group = encoded[lo : lo + round_items]
        warm = []
        for choices in group:
            n = shared_prefix(choices) if len(choices) > 1 else 0
            if n >= block + 1:  # at least one full block ahead of the first logits needed
                warm.append(choices[0].ids[:n])
        if warm:
            llm.generate(warm, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        flat = [c for choices in group for c in choices]
        params = [
            SamplingParams(
                max_tokens=1, temperature=0, prompt_logprobs=1, prompt_logprobs_start=c.start
            )
            for c in flat
        ]
        results = llm.generate([c.ids for c in flat], params, use_tqdm=False)
        it = iter(zip(flat, results))
        for choices in group:
            out.append([_choice_score(*next(it)) for _ in choices])
        if on_progress is not None:
            on_progress(len(out))
    return out


def _choice_score(enc: Encoded, result) -> ChoiceScore:
    entries = result.prompt_logprobs[enc.start :]
    if result.error is not None or any(e is None for e in entries):
        raise RuntimeError(f"scoring a choice failed: {result.error or 'no prompt logprobs'}")
    total, greedy = 0.0, True
    for token, (lp, top) in zip(enc.ids[enc.start :], entries):
        total += lp
        best = max(top.items(), key=lambda kv: kv[1])[0] if top else None
        greedy = greedy and best == token
    return ChoiceScore(total, greedy, len(entries))
