"""The parallel layers: wrappers put around one rank's loaded (sharded, fused) model.

The column-parallel Linears (fused q/k/v, fused gate/up) need no wrapper: each rank computes its
own heads / intermediate columns from the full hidden state. What needs communication:

- `RowParallel` (o_proj, down_proj): the rank's partial product, summed over the ranks with one
  all-reduce (the bias is held by rank 0 alone, runtime/distributed/sharding.py);
- `ReducedBlock` (a mixture-of-experts block): every rank routes the same tokens with the full
  router and runs its slice of every chosen expert (and of the shared expert); the weighted sum
  of partial products is the partial of the weighted sum, so one all-reduce finishes the block;
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary rows, zeros the others,
  and one all-reduce assembles the embeddings;
- `VocabParallelHead` (lm_head, applied to the sampled rows only): each rank's logits for its
  vocabulary rows are gathered on rank 0 (the sampler's), which concatenates them and drops the
  padding; the other ranks return their own part, which nobody reads.

So a decoder layer costs two all-reduces of [T, hidden] and a step one more, plus one gather.
"""

from __future__ import annotations

import torch
from torch import nn

from slimserve.runtime.distributed.group import TPGroup
from slimserve.runtime.models.moe import SparseMoeBlock


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class ReducedBlock(nn.Module):
    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor, kops) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x, kops))


class VocabParallelEmbedding(nn.Module):
    def __init__(self, inner: nn.Embedding, start: int, stop: int, group: TPGroup):
        super().__init__()
        self.inner, self.start, self.stop, self.group = inner, start, stop, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        out = self.inner(torch.where(mine, ids - self.start, 0))
        out.masked_fill_(~mine.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class VocabParallelHead(nn.Module):
    def __init__(self, inner: nn.Module, vocab_size: int, group: TPGroup):
        super().__init__()
        self.inner, self.vocab_size, self.group = inner, vocab_size, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.inner(x).float()
        parts = self.group.gather_to_first(local)
        if parts is None:
            return local
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def parallelize(model: nn.Module, group: TPGroup, vocab: tuple[int, int], vocab_size: int) -> None:
    """Wrap a loaded rank's model in place; `vocab` is its [start, stop) of the vocabulary."""
    for layer in model.model.layers:
        layer.self_attn.o_proj = RowParallel(layer.self_attn.o_proj, group)
        if isinstance(layer.ffn, SparseMoeBlock):
            setattr(layer, layer.ffn_name, ReducedBlock(layer.ffn, group))
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    if model.model.embed_tokens is not None:  # None: a pipeline stage without it
        model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, *vocab, group)
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(model.lm_head, vocab_size, group)
