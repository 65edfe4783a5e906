"""The engine's greedy outputs against a transformers model's own forward: random prompts, the
teacher-forced log-softmax at the positions that predicted the engine's tokens, and the check
that the engine's tokens are transformers' argmax and its top-5 logprobs agree."""

from __future__ import annotations

import torch


def random_prompts(lens=(5, 23, 40, 17), vocab: int = 128) -> list[list[int]]:
    """Prompts of token ids below `vocab`, one per length, the same on every call."""
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax [len(tokens), V] at the positions that predicted `tokens`."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), -1)


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' `generate`, greedy, the new tokens only."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def check_outputs(outputs, prompts, model, atol: float, with_generate: bool = False) -> float:
    """Greedy tokens equal transformers' argmax at every step (and, `with_generate`, its
    `generate`); returns the largest difference of the engine's top-5 logprobs from
    transformers', which must stay under `atol`."""
    worst = 0.0
    for prompt, out in zip(prompts, outputs):
        got = out.outputs[0]
        lp = teacher_forced(model, prompt, got.token_ids)
        assert got.token_ids == lp.argmax(-1).tolist()
        if with_generate:
            assert got.token_ids == hf_greedy(model, prompt, len(got.token_ids))
        ours = torch.tensor([list(top.values()) for _, top in got.logprobs])
        ids = [list(top) for _, top in got.logprobs]
        theirs = torch.stack([lp[j, ids[j]] for j in range(len(ids))])
        worst = max(worst, float((ours - theirs).abs().max()))
    assert worst < atol, worst
    return worst
