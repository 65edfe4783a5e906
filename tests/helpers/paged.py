"""A mixed step for the attention tests: sequences with q_lens new tokens after `starts` cached
ones, their blocks scattered over random K/V caches."""

import torch

from slimserve.runtime.batch import BatchInputs, prepare_batch


def mixed_batch(
    q_lens, starts, bs, h_kv, d, dtype, seed=7
) -> tuple[BatchInputs, torch.Tensor, torch.Tensor, torch.Generator]:
    """(batch, key cache, value cache, the generator, to draw the queries from)."""
    g = torch.Generator().manual_seed(seed)
    per_seq = [-(-(s + n) // bs) for s, n in zip(starts, q_lens)]
    ids = torch.randperm(sum(per_seq) + 2, generator=g).tolist()
    tables, at = [], 0
    for n in per_seq:
        tables.append(ids[at : at + n])
        at += n
    batch = prepare_batch(
        [[1] * n for n in q_lens], starts, tables, [True] * len(q_lens), bs, torch.device("cpu")
    )
    blocks = sum(per_seq) + 2
    kc = torch.randn(blocks, bs, h_kv, d, generator=g).to(dtype)
    vc = torch.randn(blocks, bs, h_kv, d, generator=g).to(dtype)
    return batch, kc, vc, g
