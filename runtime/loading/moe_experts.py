"""Mixture-of-experts layers with one nn.Linear per expert, under the checkpoints' names.

transformers 5 holds a sparse block's experts as one module of stacked matrices
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]) and converts the
checkpoints' per-expert tensors into them while loading (and back while saving). Nothing that
works on nn.Linear (the quantizers, `replace_linears`) can reach such a module, so `unfuse_experts`
replaces it by an `ExpertList`: an nn.ModuleList of `ExpertMLP`s whose Linears are named as on
disk (`experts.E.gate_proj` / `up_proj` / `down_proj`; Mixtral's `experts.E.w1` / `w3` / `w2`),
and Mixtral's sparse block moves from `mlp` to `block_sparse_moe`, its checkpoint name, so the
model's state-dict names are the checkpoint's.

Routing is untouched: the block's router (`gate`) and its forward stay transformers' own, and
`ExpertList.forward` is the eager loop of transformers' experts module (the same masks, order of
accumulation and dtype casts), run through the Linears. With `calibrate_all` set (compression's
calibration, compress/moe.py) every expert runs on every token, so hooks on its Linears see them
all, while the block's output still takes each token from its routed experts only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True, slots=True)
class MoeLayout:
    """Where a sparse block lives and what its experts' Linears are called."""

    block: str  # the decoder layer's attribute holding the sparse block in transformers
    disk_block: str  # the block's name in checkpoints (and in the model after `unfuse_experts`)
    proj: tuple[str, str, str]  # each expert's gate, up and down Linears, as on disk
    dense: tuple[str, ...]  # block submodules kept in full precision: the router(s)


_QWEN = ("gate_proj", "up_proj", "down_proj")
MOE_LAYOUTS: dict[str, MoeLayout] = {
    "qwen3_moe": MoeLayout("mlp", "mlp", _QWEN, ("gate",)),
    "qwen2_moe": MoeLayout("mlp", "mlp", _QWEN, ("gate", "shared_expert_gate")),
    "olmoe": MoeLayout("mlp", "mlp", _QWEN, ("gate",)),
    "mixtral": MoeLayout("mlp", "block_sparse_moe", ("w1", "w3", "w2"), ("gate",)),
}
LAYERS = "model.layers"  # the decoder layers of every architecture above


class ExpertMLP(nn.Module):
    """One expert: down(act(gate(x)) * up(x)), its Linears named `names` (gate, up, down)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act_fn: Callable[[torch.Tensor], torch.Tensor],
        names: tuple[str, str, str],
        dtype: torch.dtype,
        device: torch.device,
    ):
        super().__init__()
        self.names = names
        self.act_fn = act_fn
        kw = {"bias": False, "dtype": dtype, "device": device}
        setattr(self, names[0], nn.Linear(hidden, intermediate, **kw))
        setattr(self, names[1], nn.Linear(hidden, intermediate, **kw))
        setattr(self, names[2], nn.Linear(intermediate, hidden, **kw))

    def linears(self) -> tuple[nn.Linear, nn.Linear, nn.Linear]:
        return tuple(getattr(self, n) for n in self.names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = self.linears()
        return down(self.act_fn(gate(x)) * up(x))


class ExpertList(nn.ModuleList):
    """The experts of one sparse block, called as transformers' experts module is:
    `experts(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`."""

    def __init__(self, experts: list[ExpertMLP]):
        super().__init__(experts)
        self.calibrate_all = False  # run every expert on every token (outputs still routed)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        # transformers' eager experts loop (e.g. models/qwen3_moe/modeling_qwen3_moe.py
        # Qwen3MoeExperts.forward in the installed package), one expert's Linears at a time
        final = torch.zeros_like(hidden_states)
        num = len(self)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=num + 1).permute(2, 1, 0)
        for e, expert in enumerate(self):
            top_k_pos, token_idx = torch.where(mask[e])
            if self.calibrate_all:
                out = expert(hidden_states)[token_idx]
            elif token_idx.numel() == 0:
                continue
            else:
                out = expert(hidden_states[token_idx])
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


_ALIASED: dict[type, type] = {}


def _aliased(cls: type, alias: str, target: str) -> type:
    """A subclass of the decoder layer class `cls` (same name) whose `alias` attribute reads
    `target`: Mixtral's layer calls `self.mlp`, the block is registered as `block_sparse_moe`."""
    if cls not in _ALIASED:
        _ALIASED[cls] = type(
            cls.__name__,
            (cls,),
            {alias: property(lambda self: getattr(self, target)), "__module__": cls.__module__},
        )
    return _ALIASED[cls]


def moe_layout(model: nn.Module) -> MoeLayout | None:
    return MOE_LAYOUTS.get(getattr(getattr(model, "config", None), "model_type", None))


def sparse_blocks(model: nn.Module) -> dict[int, nn.Module]:
    """Decoder layer index -> its sparse block (one whose `experts` is an ExpertList or stacked)."""
    layout = moe_layout(model)
    if layout is None:
        return {}
    found = {}
    for i, layer in enumerate(model.get_submodule(LAYERS)):
        block = layer._modules.get(layout.disk_block) or layer._modules.get(layout.block)
        if block is not None and hasattr(block, "experts"):
            found[i] = block
    return found


@torch.no_grad()
def unfuse_experts(model: nn.Module) -> int:
    """Replace every stacked experts module of a `MOE_LAYOUTS` model by an `ExpertList` holding
    the same weights (on the same device and dtype; on meta they stay on meta), in place. Returns
    the number of sparse blocks converted (0 for another architecture or an unfused model)."""
    layout = moe_layout(model)
    if layout is None:
        return 0
    done = 0
    for layer in model.get_submodule(LAYERS):
        block = layer._modules.get(layout.block)
        experts = getattr(block, "experts", None) if block is not None else None
        if experts is None or isinstance(experts, ExpertList):
            continue
        for flag in ("is_transposed", "has_bias"):
            if getattr(experts, flag, False):
                raise ValueError(
                    f"{type(experts).__name__}.{flag} is set; unfuse_experts handles "
                    "[E, 2I, H] / [E, H, I] weights without biases only"
                )
        gate_up, down = experts.gate_up_proj, experts.down_proj
        num, two_i, hidden = gate_up.shape
        inter = two_i // 2
        if tuple(down.shape) != (num, hidden, inter):
            raise ValueError(
                f"stacked experts gate_up_proj {list(gate_up.shape)} and down_proj "
                f"{list(down.shape)} do not pair as [E, 2I, H] / [E, H, I]"
            )
        new = []
        for e in range(num):
            mlp = ExpertMLP(
                hidden, inter, experts.act_fn, layout.proj, gate_up.dtype, gate_up.device
            )
            if gate_up.device.type != "meta":
                g, u, d = mlp.linears()
                g.weight.copy_(gate_up[e, :inter])
                u.weight.copy_(gate_up[e, inter:])
                d.weight.copy_(down[e])
            new.append(mlp.requires_grad_(gate_up.requires_grad))
        block.experts = ExpertList(new)
        if layout.disk_block != layout.block:
            del layer._modules[layout.block]
            layer.add_module(layout.disk_block, block)
            layer.__class__ = _aliased(type(layer), layout.block, layout.disk_block)
        done += 1
    return done


def dense_moe_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Full names of the sparse blocks' modules kept in full precision (routers, Qwen2-MoE's
    shared_expert_gate), model order; {} for a model without sparse blocks."""
    layout = moe_layout(model)
    out: dict[str, nn.Module] = {}
    for i, block in sparse_blocks(model).items():
        name = (
            layout.disk_block
            if layout.disk_block in model.get_submodule(LAYERS)[i]._modules
            else layout.block
        )
        for rel in layout.dense:
            sub = block._modules.get(rel)
            if sub is not None:
                out[f"{LAYERS}.{i}.{name}.{rel}"] = sub
    return out
