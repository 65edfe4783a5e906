"""The parallel layers: wrappers put around one rank's loaded (sharded, fused) model.

The column-parallel Linears (fused q/k/v, fused gate/up) need no wrapper: each rank computes its
own heads / intermediate columns from the full hidden state. What needs communication:

- `RowParallel` (o_proj, down_proj): the rank's partial product, summed over the ranks with one
  all-reduce (the bias is held by rank 0 alone, runtime/distributed/sharding.py);
- `FullWidthQKNorm` (OLMoE's q/k norms over the whole projection, heads x head_dim): each rank
  holds its heads' part of q and k and of the norms' weights; the per-token sums of squares of
  both parts go through one all-reduce of [T, 2] fp32, then each rank normalizes its part by
  the whole width's mean square (where kv < N replicates a KV head, only the first rank holding
  it adds its k part);
- `ReducedBlock` (a mixture-of-experts block): every rank routes the same tokens with the full
  router and runs its slice of every chosen expert (and of the shared expert); the weighted sum
  of partial products is the partial of the weighted sum, so one all-reduce finishes the block;
- `VocabParallelEmbedding`: each rank looks up the ids in its vocabulary rows, zeros the others,
  and one all-reduce assembles the embeddings;
- `VocabParallelHead` (lm_head, applied to the sampled rows only): each rank's logits for its
  vocabulary rows are gathered on rank 0 (the sampler's), which concatenates them and drops the
  padding; the other ranks return their own part, which nobody reads.

So a decoder layer costs two all-reduces of [T, hidden] (OLMoE one more of [T, 2]) and a step
one more, plus one gather. Everything else in a layer (Gemma's sliding windows and soft caps,
Phi-3's partial rotary dims and LongRoPE, per-head norms) is per head or per element and needs
no communication; the final logit cap (Gemma) applies to the gathered logits.
"""

from __future__ import annotations

import torch
from torch import nn

from slimserve.runtime.distributed.group import TPGroup
from slimserve.runtime.distributed.sharding import ShardRanges
from slimserve.runtime.models.moe import SparseMoeBlock


class RowParallel(nn.Module):
    def __init__(self, inner: nn.Module, group: TPGroup):
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


class FullWidthQKNorm(nn.Module):
    """RMSNorm of q and k over the whole projection from this rank's part of each: the norms'
    rounding is kernels/reference.py `rms_norm`'s (normalize in fp32, round, then multiply by
    the weight in the activations' dtype); only the order of the sums of squares differs."""

    def __init__(self, group: TPGroup, q_width: int, k_width: int, adds_k: bool):
        super().__init__()
        self.group, self.q_width, self.k_width, self.adds_k = group, q_width, k_width, adds_k

    def forward(self, q: torch.Tensor, k: torch.Tensor, q_norm: nn.Module, k_norm: nn.Module):
        qf, kf = q.float(), k.float()
        k_sq = kf.pow(2).sum(-1)
        sums = torch.stack([qf.pow(2).sum(-1), k_sq if self.adds_k else torch.zeros_like(k_sq)], -1)
        self.group.all_reduce(sums)
        out = []
        for xf, x, s, width, norm in (
            (qf, q, sums[:, :1], self.q_width, q_norm),
            (kf, k, sums[:, 1:], self.k_width, k_norm),
        ):
            normed = xf * torch.rsqrt(s / width + norm.eps)
            out.append(norm.weight.to(x.dtype) * normed.to(x.dtype))
        return out[0], out[1]


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


def parallelize(model: nn.Module, group: TPGroup, ranges: ShardRanges) -> None:
    """Wrap a loaded rank's model in place; `ranges`: what this rank holds of the full model."""
    spec = ranges.spec
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.o_proj = RowParallel(attn.o_proj, group)
        if attn.qk_norm_full:
            attn.full_norm = FullWidthQKNorm(
                group,
                spec.num_heads * spec.head_dim,
                spec.num_kv_heads * spec.head_dim,
                ranges.holds_kv_first(),
            )
        if isinstance(layer.ffn, SparseMoeBlock):
            setattr(layer, layer.ffn_name, ReducedBlock(layer.ffn, group))
        else:
            layer.mlp.down_proj = RowParallel(layer.mlp.down_proj, group)
    if model.model.embed_tokens is not None:  # None: a pipeline stage without it
        start, stop, _ = ranges.vocab()
        model.model.embed_tokens = VocabParallelEmbedding(
            model.model.embed_tokens, start, stop, group
        )
    if model.lm_head is not None:
        model.lm_head = VocabParallelHead(model.lm_head, spec.vocab_size, group)
