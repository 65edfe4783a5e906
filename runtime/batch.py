"""BatchInputs: one engine step's tokens as a flat, padding-free batch, passed down the forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class BatchInputs:
    """Flat batch of B sequences with q_len_b new tokens each (T = sum q_len_b)."""

    input_ids: torch.Tensor  # int64 [T] new tokens, sequence after sequence
    positions: torch.Tensor  # int64 [T] position of each token in its sequence
    slot_mapping: torch.Tensor  # int64 [T] KV-cache slot each token's K/V is written to
    block_tables: torch.Tensor  # int32 [B, max_blocks] physical blocks of each sequence (0-padded)
    cu_seqlens_q: torch.Tensor  # int32 [B + 1] offsets of each sequence's tokens in the batch
    context_lens: torch.Tensor  # int32 [B] cached tokens per sequence after this step's writes
    logits_indices: torch.Tensor  # int64 [S] rows of the batch whose logits are sampled
    max_q_len: int  # largest q_len_b (host int: sizes the prefill grid without a device sync)
    max_context_len: int  # largest context_lens[b] (host int: sizes the split-K decode grid)
    decode_only: bool  # every sequence has exactly one new token


def prepare_batch(
    token_chunks: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    sample: list[bool],
    block_size: int,
    device: torch.device,
) -> BatchInputs:
    """Build BatchInputs on `device` from per-sequence new tokens.

    token_chunks[b]: the tokens to compute for sequence b; starts[b]: the position of the first
    one (= tokens already cached); block_tables[b]: its blocks, covering start + len(chunk)
    tokens; sample[b]: whether its last token's logits are needed.
    """
    ids, pos, slots, cu, ctx, logits_idx = [], [], [], [0], [], []
    for chunk, start, table, want in zip(token_chunks, starts, block_tables, sample):
        n = len(chunk)
        ids.extend(chunk)
        positions = range(start, start + n)
        pos.extend(positions)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in positions)
        cu.append(cu[-1] + n)
        ctx.append(start + n)
        if want:
            logits_idx.append(cu[-1] - 1)
    width = max(1, max(len(t) for t in block_tables))
    tables = torch.zeros(len(block_tables), width, dtype=torch.int32)
    for b, t in enumerate(block_tables):
        tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
    q_lens = [len(c) for c in token_chunks]

    def dev(values, dtype):
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

    return BatchInputs(
        input_ids=dev(ids, torch.int64),
        positions=dev(pos, torch.int64),
        slot_mapping=dev(slots, torch.int64),
        block_tables=tables.to(device, non_blocking=True),
        cu_seqlens_q=dev(cu, torch.int32),
        context_lens=dev(ctx, torch.int32),
        logits_indices=dev(logits_idx, torch.int64),
        max_q_len=max(q_lens),
        max_context_len=max(ctx),
        decode_only=all(n == 1 for n in q_lens),
    )
