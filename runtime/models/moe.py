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

On the Triton table (CUDA, or SLIMSERVE_KERNELS=triton) with fp16/bf16 activations, the experts
run instead as one fused MoE FFN (kernels/fused_moe.py: a grouped gate/up GEMM over the slots
sorted by expert, silu-and-mul, a grouped down GEMM with the routing weights): `stack_experts`
stacks the experts' weights once, at the block's first such forward, into [E, ...] tensors
(dense bf16/fp16 Linears; W4A16 / W8A8 QuantLinears that the Triton GEMMs serve) and rebinds
each expert's Linears to views into them, so the weights stay held once and the loop still runs
on them. Experts that do not stack (mixed formats, biases, W4A16 gate and up left unfused, an
fp32 model) keep the loop, which is also the whole CPU path.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import torch
from torch import nn

from slimserve.runtime.layers.ops import KernelOps
from slimserve.runtime.layers.quant_linear import QuantLinear
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


@functools.cache
def _fused_moe() -> ModuleType:
    """kernels/fused_moe.py, imported on first use (triton is not imported on the torch path)."""
    from slimserve.kernels import fused_moe

    return fused_moe


class StackedExperts(NamedTuple):
    """The experts' weights in kernels/fused_moe.py's stacked forms (a tensor [E, N, K],
    `MoeW4A16Weight` or `MoeW8A8Weight`)."""

    gate_up: Any  # [E, 2I, H]: each expert's gate rows, then its up rows
    down: Any  # [E, H, I]


def _expert_parts(expert: ExpertMLP) -> tuple[list[nn.Module], nn.Module]:
    """(the Linears whose output rows make gate/up, in order; down) of one expert. A fused
    `gate_up_proj` (runtime/models/fuse.py FusedLinear) is one Linear, its `inner`."""
    gate, up, down = expert.names
    fused = getattr(expert, "gate_up_proj", None)
    if fused is not None:
        return [getattr(fused, "inner", fused)], getattr(expert, down)
    return [getattr(expert, gate), getattr(expert, up)], getattr(expert, down)


def _stack_rows(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """[E, sum of the parts' rows, ...]: each expert's parts concatenated along dim 0."""
    return torch.stack([torch.cat(g) if len(g) > 1 else g[0] for g in groups])


def _views(stacked: torch.Tensor, e: int, parts: list[nn.Module]):
    """(part, rows of `stacked[e]` that are its own) for one expert's parts, in order."""
    start = 0
    for p in parts:
        yield p, stacked[e, start : start + p.out_features]
        start += p.out_features


def stack_experts(
    experts: nn.ModuleList, dtype: torch.dtype, device: torch.device
) -> StackedExperts | None:
    """The experts' weights stacked for `fused_moe` with `dtype` activations on `device`, or
    None where they do not stack (then the per-expert loop serves them). Each expert's Linears
    are rebound to views into the stacked tensors (the originals are freed), so the weights are
    held once and the loop and the state dict still see them."""
    parts = [_expert_parts(e) for e in experts]
    groups, downs = [gu for gu, _ in parts], [[d] for _, d in parts]
    mods = [m for g, d in zip(groups, downs) for m in (*g, *d)]
    if any(getattr(m, "bias", None) is not None for m in mods):
        return None
    if all(type(m) is nn.Linear for m in mods):
        if any(m.weight.dtype != dtype or m.weight.device != device for m in mods):
            return None
        stacked = []
        for gs in (groups, downs):
            w = _stack_rows([[p.weight.detach() for p in g] for g in gs])
            for e, g in enumerate(gs):
                for p, rows in _views(w, e, g):
                    p.weight.data = rows
            stacked.append(w)
        return StackedExperts(*stacked)
    if not all(isinstance(m, QuantLinear) and m.weight_scale.device == device for m in mods):
        return None
    fm = _fused_moe()
    path = {m._kernel_path() for m in mods}
    if path == {"w8a8"}:
        if len({m.weight_scale.dtype for m in mods}) > 1:
            return None
        stacked = []
        for gs in (groups, downs):
            w = _stack_rows([[p.weight for p in g] for g in gs])
            s = _stack_rows([[p.weight_scale.reshape(-1) for p in g] for g in gs])
            for e, g in enumerate(gs):
                for (p, rows), (_, scales) in zip(_views(w, e, g), _views(s, e, g)):
                    p.weight, p.weight_scale = rows, scales.unsqueeze(1)  # registered buffers
            stacked.append(fm.MoeW8A8Weight(w, s))
        return StackedExperts(*stacked)
    if path == {"w4a16"} and all(len(g) == 1 for g in groups):
        # the W4A16 layout holds N last: a gate or up slice of a stacked [K words, 2I] would not
        # be contiguous for the per-expert kernel, so only a fused gate_up_proj stacks
        for m in mods:
            if "_prepared" not in m.__dict__:  # a model outside the engine keeps its buffers
                m.prepare_kernel(release=False)
        try:
            stacked = [fm.stack_w4a16([g[0]._prepared for g in gs]) for gs in (groups, downs)]
        except ValueError:  # experts of different layouts: the loop serves them
            return None
        for st, gs in zip(stacked, (groups, downs)):
            for e, g in enumerate(gs):
                g[0]._prepared = st.expert(e)
        return StackedExperts(*stacked)
    return None


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

    def stacked_experts(self, x: torch.Tensor) -> StackedExperts | None:
        """The experts stacked for the fused kernel (`stack_experts`, built at the first call
        for x's device and dtype and kept), or None: the per-expert loop serves them."""
        key = (x.device, x.dtype)
        cached = self.__dict__.get("_stacked")
        if cached is None or cached[0] != key:
            half = x.dtype in (torch.float16, torch.bfloat16)  # the kernels' activations
            stacked = stack_experts(self.experts, x.dtype, x.device) if half else None
            cached = self.__dict__["_stacked"] = (key, stacked)
        return cached[1]

    def forward(self, x: torch.Tensor, kops: KernelOps) -> torch.Tensor:
        weights, ids = self.route(x)
        stacked = self.stacked_experts(x) if kops.triton else None
        if stacked is not None:
            out = _fused_moe().fused_moe(
                x.contiguous(), stacked.gate_up, stacked.down, weights, ids, use_kernel=True
            )
        else:
            out = self.experts_loop(x, weights, ids, kops)
        if hasattr(self, "shared_expert"):
            shared = self.shared_expert(x, kops)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out

    def experts_loop(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, kops: KernelOps
    ) -> torch.Tensor:
        """The routed experts' sum, one GEMM chain per expert that received tokens."""
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
        return out
