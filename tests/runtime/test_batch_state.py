"""Batch state kept across steps instead of rebuilt: a sequence's token list grows in place, and
block tables become tensors incrementally (runtime/sequence.py, runtime/batch.py)."""

from __future__ import annotations

import random

import torch

from slimserve.runtime.batch import BlockTableCache, prepare_batch
from slimserve.runtime.sequence import SamplingParams, Sequence


def test_token_ids_is_one_list_grown_in_place():
    prompt = [5, 6, 7]
    seq = Sequence("r", prompt, SamplingParams())
    ids = seq.token_ids
    assert ids == [5, 6, 7] and ids is not prompt
    for t in (8, 9):
        seq.output_token_ids.append(t)
        assert seq.token_ids is ids and ids == [5, 6, 7, *seq.output_token_ids]
    assert prompt == [5, 6, 7]  # the prompt list is never touched
    seq.output_token_ids = [1]  # replaced (not appended): rebuilt from scratch
    assert seq.token_ids == [5, 6, 7, 1]


def _naive(tables):
    width = max(1, max(len(t) for t in tables))
    out = torch.zeros(len(tables), width, dtype=torch.int32)
    for b, t in enumerate(tables):
        out[b, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out


def test_block_table_cache_matches_a_fresh_table_across_steps():
    rng = random.Random(0)
    cache = BlockTableCache()
    tables = [[rng.randrange(1000) for _ in range(rng.randint(0, 5))] for _ in range(6)]
    for _ in range(200):
        for i, t in enumerate(tables):
            r = rng.random()
            if r < 0.3:
                t.append(rng.randrange(1000))  # the block manager appends in place
            elif r < 0.35:
                tables[i] = [rng.randrange(1000) for _ in range(rng.randint(0, 3))]  # freed, re-admitted
        step = [t for t in tables if rng.random() < 0.8] or tables[:1]  # some sit a step out
        assert torch.equal(cache.table(step), _naive(step))


def test_block_table_cache_reuses_unchanged_rows_and_drops_absent_ones():
    cache = BlockTableCache()
    a, b = [1, 2], [3]
    cache.table([a, b])
    ta = cache._rows[id(a)][1]
    cache.table([a, b])
    assert cache._rows[id(a)][1] is ta  # unchanged: no new tensor
    a.append(4)
    cache.table([a])
    assert cache._rows[id(a)][1].tolist() == [1, 2, 4] and id(b) not in cache._rows


def test_prepare_batch_with_and_without_the_cache_agree():
    cache = BlockTableCache()
    chunks, starts, tables = [[1, 2, 3], [4]], [0, 20], [[7], [2, 9]]
    args = (chunks, starts, tables, [True, True], 16, torch.device("cpu"))
    a, b = prepare_batch(*args), prepare_batch(*args, cache)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "cu_seqlens_q",
                 "context_lens", "logits_indices"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert b.slot_mapping.tolist() == [112, 113, 114, 9 * 16 + 4]
