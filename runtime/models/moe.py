"""Mixture-of-experts feed-forward blocks: Qwen3-MoE, Qwen2-MoE (with its shared expert),
Mixtral and OLMoE, over our flat, padding-free token batch.

Checkpoints (what transformers' `save_pretrained` writes and vLLM reads) hold one set of
Linears per expert: `mlp.experts.E.{gate_proj,up_proj,down_proj}` (Mixtral:
`block_sparse_moe.experts.E.{w1,w3,w2}`), and the router `gate` [E, H]. The block keeps those
names, so artifacts load strictly into it and each expert's Linears are swapped for QuantLinear
by the same rules as dense ones (runtime/loading/loader.py `replace_linears`); the router and
the shared expert's gate stay dense unless the artifact quantized them.

The forward routes as transformers defines each architecture (softmax in fp32, top-k,
renormalized when the config says so; Mixtral always), groups the tokens by expert (one sort)
and runs one GEMM chain per expert that received tokens, so a decode step touches only the
active experts' weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from slimserve.runtime.layers.ops import KernelOps
from slimserve.runtime.loading.moe_experts import MOE_LAYOUTS

# the checkpoint names (sparse block, each expert's gate/up/down) are the compress side's too
MOE_MODEL_TYPES = tuple(MOE_LAYOUTS)
_QWEN_NAMES = MOE_LAYOUTS["qwen3_moe"].proj  # the shared expert's Linears


@dataclass(frozen=True)
class MoeSpec:
    """The routing and expert shapes of a mixture-of-experts model (from config.json)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    renormalize: bool  # top-k weights divided by their sum
    weights_fp32: bool  # top-k weights applied in fp32 (Mixtral) or cast to the model dtype
    shared_intermediate_size: int  # Qwen2-MoE's shared expert; 0: none
    block_name: str  # the decoder layer's attribute: "mlp" or "block_sparse_moe"
    expert_names: tuple[str, str, str]  # (gate, up, down) Linears of one expert
    sparse_layers: tuple[bool, ...]  # per decoder layer: a MoE block (True) or a dense MLP


def moe_spec(config, num_layers: int) -> MoeSpec | None:
    """MoeSpec of a transformers config, or None for a dense model type."""
    mt = getattr(config, "model_type", None)
    layout = MOE_LAYOUTS.get(mt)
    if layout is None:
        return None
    block, names = layout.disk_block, layout.proj
    if mt == "mixtral":  # always renormalized, weights applied in fp32
        experts, renorm, fp32 = config.num_local_experts, True, True
        inter = config.intermediate_size
    else:
        experts, renorm, fp32 = (
            config.num_experts,
            bool(getattr(config, "norm_topk_prob", False)),
            False,
        )
        inter = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    sparse = [True] * num_layers
    if mt in ("qwen3_moe", "qwen2_moe"):  # dense layers between or instead of MoE ones
        only_dense = set(getattr(config, "mlp_only_layers", None) or [])
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = [i not in only_dense and (i + 1) % step == 0 for i in range(num_layers)]
    return MoeSpec(
        num_experts=experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=inter,
        renormalize=renorm,
        weights_fp32=fp32,
        shared_intermediate_size=(
            getattr(config, "shared_expert_intermediate_size", 0) if mt == "qwen2_moe" else 0
        ),
        block_name=block,
        expert_names=names,
        sparse_layers=tuple(sparse),
    )


class ExpertMLP(nn.Module):
    """SiLU-gated MLP whose three Linears carry the checkpoint's names (`names`: gate, up,
    down). `runtime/models/fuse.py` may replace gate and up by one `gate_up_proj`."""

    def __init__(self, hidden: int, inter: int, names: tuple[str, str, str] = _QWEN_NAMES):
        super().__init__()
        self.names = names
        gate, up, down = names
        setattr(self, gate, nn.Linear(hidden, inter, bias=False))
        setattr(self, up, nn.Linear(hidden, inter, bias=False))
        setattr(self, down, nn.Linear(inter, hidden, bias=False))

    def forward(self, x: torch.Tensor, kops: KernelOps) -> torch.Tensor:
        gate, up, down = self.names
        if hasattr(self, "gate_up_proj"):
            h = self.gate_up_proj(x)
        else:
            h = torch.cat([getattr(self, gate)(x), getattr(self, up)(x)], -1)
        return getattr(self, down)(kops.silu_and_mul(h))


class SparseMoeBlock(nn.Module):
    """Router + experts (+ Qwen2-MoE's sigmoid-gated shared expert) for [T, H] tokens."""

    def __init__(self, hidden: int, moe: MoeSpec):
        super().__init__()
        self.top_k, self.num_experts = moe.top_k, moe.num_experts
        self.renormalize, self.weights_fp32 = moe.renormalize, moe.weights_fp32
        self.gate = nn.Linear(hidden, moe.num_experts, bias=False)
        self.experts = nn.ModuleList(
            ExpertMLP(hidden, moe.intermediate_size, moe.expert_names)
            for _ in range(moe.num_experts)
        )
        if moe.shared_intermediate_size:
            self.shared_expert = ExpertMLP(hidden, moe.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) as the architecture's router computes them."""
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_fp32:
            weights = weights.to(logits.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor, kops: KernelOps) -> torch.Tensor:
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        w = weights.reshape(-1)[order].unsqueeze(-1)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            y = self.experts[e](x[rows], kops) * w[start : start + n]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x, kops)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out
