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
    # the leading sequences with one new token each (the engine puts them first): a mixed
    # step's attention runs them on the decode kernel and the rest on the prefill kernel
    num_decodes: int = 0


class BlockTableCache:
    """Each sequence's block table as a tensor, kept from step to step and rebuilt only when the
    list grows, so a step's [B, max_blocks] table is one `pad_sequence` over cached tensors
    instead of B list-to-tensor copies of whole tables.

    Keyed by the block-table list object itself: the block manager only ever appends to a
    sequence's list, and gives it a new list when the sequence is freed or re-admitted, so a
    cached tensor is valid while it is the same list with the same length. Entries of sequences
    absent from a step are dropped (one rebuild if they come back).
    """

    def __init__(self) -> None:
        self._rows: dict[int, tuple[list[int], torch.Tensor]] = {}  # id(list) -> (list, tensor)

    def table(self, block_tables: list[list[int]]) -> torch.Tensor:
        """int32 [B, max blocks] (0-padded) of this step's sequences, on the CPU."""
        rows, tensors = {}, []
        for t in block_tables:
            hit = self._rows.get(id(t))
            if hit is None or hit[0] is not t or hit[1].shape[0] != len(t):
                hit = (t, torch.tensor(t, dtype=torch.int32))
            rows[id(t)] = hit
            tensors.append(hit[1])
        self._rows = rows
        if not any(len(t) for t in block_tables):
            return torch.zeros(len(block_tables), 1, dtype=torch.int32)
        return torch.nn.utils.rnn.pad_sequence(tensors, batch_first=True)


class StagingBuffer:
    """One host buffer per step for every field of a batch, so a step's inputs reach the device
    in ONE host-to-device copy instead of seven (ids, positions, slots, block tables, offsets,
    context lengths, logits rows), from pinned memory and non-blocking on CUDA.

    Two buffers alternate, each with the CUDA event recorded after its copy: a buffer is written
    again only once its copy of two steps ago has completed (today the sampler's device-to-host
    read already orders every step after the last, so the wait returns at once; it keeps the
    buffer safe if the next step's host work is ever overlapped with this one's GPU work). The
    buffers grow to the largest step seen and are kept.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._pin = device.type == "cuda"
        self._host: list[torch.Tensor] = [torch.empty(0, dtype=torch.int64)] * 2
        self._done: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.copies = 0  # host-to-device copies made (one per step)

    def _buffer(self, n: int) -> torch.Tensor:
        i = self._turn
        if self._done[i] is not None:
            self._done[i].synchronize()
        if self._host[i].numel() < n:
            size = max(n, 2 * self._host[i].numel())
            self._host[i] = torch.empty(size, dtype=torch.int64, pin_memory=self._pin)
        return self._host[i]

    def upload(
        self, fields: list[list[int]], table: torch.Tensor
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """int64 device views of `fields` (in order) and of the [B, W] `table`."""
        sizes = [len(f) for f in fields]
        n = sum(sizes)
        host = self._buffer(n + table.numel())
        host[:n].copy_(torch.tensor([v for f in fields for v in f], dtype=torch.int64))
        host[n : n + table.numel()].view(table.shape).copy_(table)
        # copy=True: on the CPU (tests) the views must not alias a buffer that is reused
        dev = host[: n + table.numel()].to(self.device, non_blocking=True, copy=True)
        self.copies += 1
        if self._pin:
            event = torch.cuda.Event()
            event.record()
            self._done[self._turn] = event
        self._turn ^= 1
        parts = list(dev[:n].split(sizes))
        return parts, dev[n:].view(table.shape)


def prepare_batch(
    token_chunks: list[list[int]],
    starts: list[int],
    block_tables: list[list[int]],
    sample: list[bool],
    block_size: int,
    device: torch.device,
    table_cache: BlockTableCache | None = None,
    staging: StagingBuffer | None = None,
    extra_rows: list[range] | None = None,
) -> BatchInputs:
    """Build BatchInputs on `device` from per-sequence new tokens.

    token_chunks[b]: the tokens to compute for sequence b; starts[b]: the position of the first
    one (= tokens already cached); block_tables[b]: its blocks, covering start + len(chunk)
    tokens; sample[b]: whether its last token's logits are needed. `table_cache` (the runner's)
    makes the block-table tensor incremental across steps; `staging` (the runner's, on a GPU)
    sends every field in one copy. extra_rows[b]: more offsets into chunk b (before its last
    token) whose logits are wanted too (prompt logprobs); the logits rows then go sequence by
    sequence, each sequence's extra rows first, then its sampled row.
    """
    ids, pos, slots, cu, ctx, logits_idx = [], [], [], [0], [], []
    extra = extra_rows or [range(0)] * len(token_chunks)
    for chunk, start, table, want, more in zip(token_chunks, starts, block_tables, sample, extra):
        n = len(chunk)
        logits_idx.extend(cu[-1] + r for r in more)
        ids.extend(chunk)
        positions = range(start, start + n)
        pos.extend(positions)
        slots.extend(table[p // block_size] * block_size + p % block_size for p in positions)
        cu.append(cu[-1] + n)
        ctx.append(start + n)
        if want:
            logits_idx.append(cu[-1] - 1)
    tables = (table_cache or BlockTableCache()).table(block_tables)
    q_lens = [len(c) for c in token_chunks]
    if staging is not None:
        (ids_d, pos_d, slots_d, cu_d, ctx_d, logits_d), tables_d = staging.upload(
            [ids, pos, slots, cu, ctx, logits_idx], tables
        )
        # the int32 fields travel as int64 in the one buffer
        cu_d, ctx_d, tables_d = (t.to(torch.int32) for t in (cu_d, ctx_d, tables_d))
    else:

        def dev(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        ids_d, pos_d, slots_d = (
            dev(ids, torch.int64),
            dev(pos, torch.int64),
            dev(slots, torch.int64),
        )
        cu_d, ctx_d, logits_d = (
            dev(cu, torch.int32),
            dev(ctx, torch.int32),
            dev(logits_idx, torch.int64),
        )
        tables_d = tables.to(device, non_blocking=True)
    return BatchInputs(
        input_ids=ids_d,
        positions=pos_d,
        slot_mapping=slots_d,
        block_tables=tables_d,
        cu_seqlens_q=cu_d,
        context_lens=ctx_d,
        logits_indices=logits_d,
        max_q_len=max(q_lens),
        max_context_len=max(ctx),
        decode_only=all(n == 1 for n in q_lens),
        num_decodes=next((i for i, n in enumerate(q_lens) if n != 1), len(q_lens)),
    )
