"""Batch state kept across steps instead of rebuilt: a sequence's token list grows in place, and
block tables become tensors incrementally (runtime/engine/sequence.py, runtime/batch.py)."""

from __future__ import annotations

import random

import pytest
import torch

from slimserve.runtime.batch import BlockTableCache, StagingBuffer, prepare_batch
from slimserve.runtime.engine.sequence import SamplingParams, Sequence


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
        out[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
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
                tables[i] = [
                    rng.randrange(1000) for _ in range(rng.randint(0, 3))
                ]  # freed, re-admitted
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
    for name in (
        "input_ids",
        "positions",
        "slot_mapping",
        "block_tables",
        "cu_seqlens_q",
        "context_lens",
        "logits_indices",
    ):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert b.slot_mapping.tolist() == [112, 113, 114, 9 * 16 + 4]


FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "block_tables",
    "cu_seqlens_q",
    "context_lens",
    "logits_indices",
)


def _staged_steps(device: torch.device):
    """(direct, staged) batches of a few steps of growing size, through one StagingBuffer."""
    staging = StagingBuffer(device)
    rng = random.Random(3)
    out = []
    for step in range(6):
        b = 1 + step * 3
        chunks = [
            [rng.randrange(1, 500) for _ in range(rng.choice((1, 1, 5, 40)))] for _ in range(b)
        ]
        starts = [rng.randrange(0, 60) for _ in range(b)]
        tables = [
            list(range(100 * i, 100 * i + (s + len(c)) // 16 + 1))
            for i, (s, c) in enumerate(zip(starts, chunks))
        ]
        sample = [rng.random() < 0.8 for _ in range(b)]
        args = (chunks, starts, tables, sample, 16, device)
        out.append((prepare_batch(*args), prepare_batch(*args, None, staging)))
    return staging, out


def _check_staged(device):
    staging, steps = _staged_steps(device)
    for direct, staged in steps:
        for name in FIELDS:
            a, b = getattr(direct, name), getattr(staged, name)
            assert a.dtype == b.dtype and a.device == b.device and torch.equal(a, b), name
        assert (direct.max_q_len, direct.max_context_len, direct.decode_only) == (
            staged.max_q_len,
            staged.max_context_len,
            staged.decode_only,
        )
    assert staging.copies == len(steps)  # one upload per step


def test_staged_batch_equals_the_field_by_field_one():
    _check_staged(torch.device("cpu"))


@pytest.mark.gpu
def test_staged_batch_is_one_pinned_copy_on_cuda():
    _check_staged(torch.device("cuda"))
    staging = StagingBuffer(torch.device("cuda"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        prepare_batch(
            [[1, 2, 3], [4]],
            [0, 20],
            [[7], [2, 9]],
            [True, True],
            16,
            torch.device("cuda"),
            None,
            staging,
        )
        torch.cuda.synchronize()
    h2d = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert len(h2d) == 1, [e.name for e in prof.events()]
    assert staging._host[0].is_pinned()
