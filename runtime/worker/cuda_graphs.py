"""Decode-only steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's design).

A decode step launches a few hundred small kernels whose host-side launch cost exceeds their GPU
time at small batches; a captured graph replays them all with one launch. Graphs freeze every
tensor address and shape, so the step's inputs live in static buffers sized for the largest
bucket, and a batch of n sequences runs the graph of the smallest bucket >= n with the rows
past n padded: token 0 at position 0, KV slot -1 (the fused RoPE + KV-cache write skips it, so
no cache block is touched), context length 0 and an all-zero block table. Every op of the
forward is row-independent, so padding rows cannot change the real rows; their logits are
dropped. The attention grid is sized by the block table's capacity (max_context_len = blocks per
sequence x block size), not by this step's longest context, so one graph serves every step.

Buckets: 1, 2, 4, then every multiple of 8, up to max_num_seqs (always included). Graphs are
captured from the largest bucket down into one shared memory pool, after the weights are
prepared and the KV cache is allocated (the graphs record the caches' addresses). Steps that
carry a prompt chunk, or more sequences or blocks than the buffers hold, run eagerly.

Without CUDA (and with capture off) `run` computes the same padded batch eagerly over the same
static buffers, which is how the CPU tests check the bucketing, padding and buffer logic.
"""

from __future__ import annotations

import logging
import time

import torch

from slimserve.runtime.batch import BatchInputs

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... (multiples of 8) below max_num_seqs, then max_num_seqs."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs, 8))
    return sizes + [max_num_seqs]


def bucket_for(n: int, sizes: list[int]) -> int | None:
    """The smallest bucket holding n sequences, or None when n exceeds the largest."""
    return next((s for s in sizes if s >= n), None)


class DecodeGraphs:
    """Static decode buffers and, on CUDA once `capture()` ran, one graph per bucket."""

    def __init__(
        self,
        model,
        kv_caches,
        max_num_seqs: int,
        max_blocks: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_blocks, self.block_size = max_blocks, block_size
        b = self.sizes[-1]
        z = dict(device=device)
        self.input_ids = torch.zeros(b, dtype=torch.int64, **z)
        self.positions = torch.zeros(b, dtype=torch.int64, **z)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, **z)
        self.context_lens = torch.zeros(b, dtype=torch.int32, **z)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int32, **z)
        self.cu_seqlens_q = torch.arange(b + 1, dtype=torch.int32, **z)  # one token per row
        self.logits_indices = torch.arange(b, dtype=torch.int64, **z)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's static logits [size, vocab]

    def view(self, size: int) -> BatchInputs:
        """The static buffers' first `size` rows as a decode-only batch."""
        return BatchInputs(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            cu_seqlens_q=self.cu_seqlens_q[: size + 1],
            context_lens=self.context_lens[:size],
            logits_indices=self.logits_indices[:size],
            max_q_len=1,
            max_context_len=self.max_blocks * self.block_size,
            decode_only=True,
            num_decodes=size,
        )

    def can_run(self, batch: BatchInputs) -> bool:
        """A decode-only step whose every sequence samples, within the buffers' size."""
        n = batch.input_ids.shape[0]
        return (
            batch.decode_only
            and n <= self.sizes[-1]
            and batch.logits_indices.shape[0] == n
            and batch.block_tables.shape[1] <= self.max_blocks
        )

    def fill(self, batch: BatchInputs) -> int:
        """Copy the step's rows into the static buffers, pad up to the bucket; the bucket size."""
        n, w = batch.input_ids.shape[0], batch.block_tables.shape[1]
        size = bucket_for(n, self.sizes)
        assert size is not None and self.can_run(batch), (n, w)
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(batch.context_lens, non_blocking=True)
        self.block_tables[:n, :w].copy_(batch.block_tables, non_blocking=True)
        self.block_tables[:n, w:].zero_()
        if size > n:  # padding rows: no cache write, nothing to attend to
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.context_lens[n:size].zero_()
            self.block_tables[n:size].zero_()
        return size

    def capture(self) -> None:
        """One graph per bucket, largest first, in one shared memory pool (CUDA only)."""
        t0, pool = time.perf_counter(), None
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            batch = self.view(size)
            self.slot_mapping[:size].fill_(-1)  # the warm-up and capture runs write no cache
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.model(batch, self.kv_caches)  # warm-up: compiles kernels, allocates outside
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(batch, self.kv_caches)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
        log.info(
            "captured %d decode CUDA graphs (batch %s) in %.1f s",
            len(self.graphs),
            ",".join(map(str, self.sizes)),
            time.perf_counter() - t0,
        )

    def run(self, batch: BatchInputs) -> torch.Tensor:
        """fp32 logits [n, vocab] of a decode-only step: the bucket's graph replayed, or (not
        captured) the same padded batch computed eagerly over the static buffers."""
        n = batch.input_ids.shape[0]
        size = self.fill(batch)
        graph = self.graphs.get(size)
        if graph is None:
            return self.model(self.view(size), self.kv_caches)[:n]
        graph.replay()
        return self.outputs[size][:n]
