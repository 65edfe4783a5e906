"""Structured pruning of Llama-family decoders: choose what to keep, slice the tensors, rebuild.

Pruning is uniform across layers (every layer keeps the same number of heads and channels, each
layer choosing its own), so the result is an ordinary config with smaller numbers and loads in
any Llama implementation. The pruned model is rebuilt from that config and loaded strictly from
the sliced state dict: nothing of the old module objects survives, layer indices are renumbered.

Tensor layouts (HF Linear weights are [out_features, in_features]):
  q_proj [n_q * d, H]   k_proj / v_proj [n_kv * d, H]   o_proj [H, n_q * d]
  gate_proj / up_proj [F, H]   down_proj [H, F]   norms [H]   embed_tokens / lm_head [V, H]
Query head h uses rows h*d:(h+1)*d of q_proj and reads KV head h // (n_q / n_kv).
Mixture-of-experts blocks (experts, their channels, the router) are sliced by the rules of
compress/prune/experts.py; the rebuilt model gets per-expert Linears (compress/moe.py) first.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from slimserve.compress.errors import UnsupportedModelError
from slimserve.compress.mappings import mapping_for
from slimserve.compress.moe import prepare_model
from slimserve.compress.prune.experts import (
    block_rule,
    choose_experts,
    expert_key,
    resize_moe_config,
)
from slimserve.compress.prune.importance import ExpertScores
from slimserve.compress.prune.sizes import Dims, MoeDims

# Llama-family tensor names relative to a decoder layer -> (pruned row index, pruned column index).
# 'q' = query-head rows/cols, 'kv' = KV-head rows, 'mlp' = MLP channels, 'h' = hidden channels.
LAYER_TENSORS: dict[str, tuple[str | None, str | None]] = {
    "self_attn.q_proj.weight": ("q", "h"),
    "self_attn.q_proj.bias": ("q", None),
    "self_attn.k_proj.weight": ("kv", "h"),
    "self_attn.k_proj.bias": ("kv", None),
    "self_attn.v_proj.weight": ("kv", "h"),
    "self_attn.v_proj.bias": ("kv", None),
    "self_attn.o_proj.weight": ("h", "q"),
    "self_attn.o_proj.bias": ("h", None),
    "self_attn.q_norm.weight": (None, None),
    "self_attn.k_norm.weight": (None, None),  # [head_dim]
    "mlp.gate_proj.weight": ("mlp", "h"),
    "mlp.up_proj.weight": ("mlp", "h"),
    "mlp.down_proj.weight": ("h", "mlp"),
    "mlp.gate_proj.bias": ("mlp", None),
    "mlp.up_proj.bias": ("mlp", None),
    "mlp.down_proj.bias": ("h", None),
    "input_layernorm.weight": ("h", None),
    "post_attention_layernorm.weight": ("h", None),
}
# Tensors outside the decoder layers.
OUTER_TENSORS: dict[str, tuple[str | None, str | None]] = {
    "model.embed_tokens.weight": (None, "h"),
    "model.norm.weight": ("h", None),
    "lm_head.weight": (None, "h"),
}


@dataclass(frozen=True, slots=True)
class LayerPlan:
    source: int  # index of this layer in the model before pruning
    q_heads: tuple[int, ...]  # query heads kept (old indices, ascending, so grouped by KV head)
    kv_heads: tuple[int, ...]  # KV heads kept (old indices, ascending)
    channels: tuple[int, ...]  # MLP channels kept (old indices, ascending; dense layers)
    experts: tuple[int, ...] | None = None  # experts kept (old indices, ascending); None: dense
    expert_channels: tuple[tuple[int, ...], ...] | None = None  # per kept expert, channels kept


@dataclass(frozen=True, slots=True)
class PrunePlan:
    before: Dims  # shape before pruning
    after: Dims  # shape after pruning
    layers: tuple[LayerPlan, ...]  # one per kept layer, in order
    hidden: tuple[int, ...]  # hidden channels kept (old indices, ascending)
    moe_before: MoeDims | None = None  # sparse blocks before pruning (None: a dense model)
    moe_after: MoeDims | None = None  # and after


def top_k(scores: torch.Tensor, k: int) -> tuple[int, ...]:
    """Indices of the k largest scores, ascending (ties: the lower index wins, deterministically)."""
    order = torch.sort(scores.float(), descending=True, stable=True).indices[:k]
    return tuple(sorted(order.tolist()))


def choose_heads(
    scores: torch.Tensor, before: Dims, after: Dims
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(query heads, KV heads) a layer keeps, from per-query-head scores [n_q].

    A KV group scores the sum of its query heads; the best `after.num_key_value_heads` groups
    stay, and inside each the best `after.heads_per_group` query heads.
    """
    group = before.heads_per_group
    by_group = scores.view(before.num_key_value_heads, group)  # [n_kv, heads per group]
    kv = top_k(by_group.sum(dim=1), after.num_key_value_heads)
    per_group = after.num_attention_heads // after.num_key_value_heads
    q = tuple(g * group + h for g in kv for h in top_k(by_group[g], per_group))
    return q, kv


def make_plan(
    before: Dims,
    after: Dims,
    head_scores: torch.Tensor,
    channel_scores: torch.Tensor,
    hidden_scores: torch.Tensor,
    layer_scores: torch.Tensor | None,
    expert_scores: list[ExpertScores | None] | None = None,
    moe_before: MoeDims | None = None,
    moe_after: MoeDims | None = None,
    expert_method: str = "weight",
) -> PrunePlan:
    """Keep the highest-scoring parts. Scores: heads [L, n_q], channels [L, F], hidden [H], layers [L].

    `layer_scores` may be None only when no layer is removed. A mixture of experts also gives
    `expert_scores` (per layer, None for a dense one) and its sparse shape before and after;
    ranking experts needs measured routing (`ExpertScores.measured`) only when experts go.
    """
    if after.num_layers < before.num_layers:
        assert layer_scores is not None, "removing layers needs layer scores"
        kept_layers = top_k(layer_scores, after.num_layers)
    else:
        kept_layers = tuple(range(before.num_layers))
    plans = []
    for i in kept_layers:
        q, kv = choose_heads(head_scores[i], before, after)
        ch = top_k(channel_scores[i], after.intermediate_size)
        sc = expert_scores[i] if expert_scores is not None else None
        if sc is None:
            plans.append(LayerPlan(i, q, kv, ch))
            continue
        if moe_after.num_experts < moe_before.num_experts:
            experts = choose_experts(sc, moe_after.num_experts, expert_method)
        else:
            experts = tuple(range(moe_before.num_experts))
        width = moe_after.intermediate_size
        per_expert = tuple(top_k(sc.channels[e], width) for e in experts)
        plans.append(LayerPlan(i, q, kv, ch, experts, per_expert))
    return PrunePlan(
        before,
        after,
        tuple(plans),
        top_k(hidden_scores, after.hidden_size),
        moe_before,
        moe_after,
    )


def _rows_of_heads(heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Row indices [len(heads) * head_dim] of the given heads in a [n * head_dim, ...] projection."""
    return torch.tensor(
        [h * head_dim + j for h in heads for j in range(head_dim)], dtype=torch.long
    )


def _slice(
    t: torch.Tensor, rule: tuple[str | None, str | None], index: dict[str, torch.Tensor]
) -> torch.Tensor:
    out = t
    for dim, kind in enumerate(rule):
        if kind is not None:
            out = out.index_select(dim, index[kind])
    return out.contiguous()


def slice_state_dict(
    state: dict[str, torch.Tensor], plan: PrunePlan, layers_path: str
) -> dict[str, torch.Tensor]:
    """The state dict of the pruned model: kept slices, layers renumbered 0..L'-1.

    Raises UnsupportedModelError for a tensor whose layout is unknown (rather than guess).
    """
    d = plan.before.head_dim
    hidden = torch.tensor(plan.hidden, dtype=torch.long)
    out: dict[str, torch.Tensor] = {}
    by_source = {lp.source: (new, lp) for new, lp in enumerate(plan.layers)}
    prefix = layers_path + "."
    model_type = plan.moe_before.model_type if plan.moe_before is not None else None
    for key, t in state.items():
        if not key.startswith(prefix):
            if key not in OUTER_TENSORS:
                raise UnsupportedModelError(
                    f"{key}: pruning does not know this tensor's layout; "
                    "structured pruning supports Llama-family decoders only"
                )
            out[key] = _slice(t, OUTER_TENSORS[key], {"h": hidden})
            continue
        old, _, rel = key[len(prefix) :].partition(".")
        moe = block_rule(rel, model_type) if rel not in LAYER_TENSORS else None
        if rel not in LAYER_TENSORS and moe is None:
            raise UnsupportedModelError(
                f"{key}: pruning does not know this tensor's layout; structured pruning "
                "supports Llama-family decoders and the mixtures of experts of "
                "runtime/loading/moe_experts.py only"
            )
        if int(old) not in by_source:
            continue  # a removed layer
        new, lp = by_source[int(old)]
        index = {
            "h": hidden,
            "q": _rows_of_heads(lp.q_heads, d),
            "kv": _rows_of_heads(lp.kv_heads, d),
            "mlp": torch.tensor(lp.channels, dtype=torch.long),
        }
        if moe is None:
            out[f"{prefix}{new}.{rel}"] = _slice(t, LAYER_TENSORS[rel], index)
            continue
        index["experts"] = torch.tensor(lp.experts, dtype=torch.long)
        if moe.expert is not None:
            if moe.expert not in lp.experts:
                continue  # a removed expert
            pos = lp.experts.index(moe.expert)
            index["ech"] = torch.tensor(lp.expert_channels[pos], dtype=torch.long)
            rel = expert_key(model_type, pos, moe.rest)
        out[f"{prefix}{new}.{rel}"] = _slice(t, moe.rule, index)
    return out


def resize_config(
    config,
    dims: Dims,
    kept_layers: Sequence[int],
    moe_before: MoeDims | None = None,
    moe_after: MoeDims | None = None,
):
    """A copy of `config` at shape `dims` keeping layers `kept_layers` (old indices, for per-layer
    fields such as layer_types) with sparse blocks of shape `moe_after`; head_dim is always
    written explicitly."""
    cfg = copy.deepcopy(config)
    cfg.hidden_size, cfg.intermediate_size = dims.hidden_size, dims.intermediate_size
    cfg.num_attention_heads, cfg.num_key_value_heads = (
        dims.num_attention_heads,
        dims.num_key_value_heads,
    )
    cfg.head_dim, cfg.num_hidden_layers = dims.head_dim, dims.num_layers
    types = getattr(cfg, "layer_types", None)
    if types is not None:  # per-layer attention types (sliding/full) follow their layers
        cfg.layer_types = [types[i] for i in kept_layers]
    if moe_after is not None:
        resize_moe_config(cfg, moe_before, moe_after, kept_layers)
    return cfg


def pruned_config(config, plan: PrunePlan):
    """The config of the model `plan` produces."""
    kept = [lp.source for lp in plan.layers]
    return resize_config(config, plan.after, kept, plan.moe_before, plan.moe_after)


def apply_plan(model: nn.Module, plan: PrunePlan) -> nn.Module:
    """A new model of the same class at the pruned shape holding the kept slices of `model`.

    Same dtype and device as `model`, in eval mode, generation config carried over.
    """
    from transformers.initialization import no_init_weights

    mapping = mapping_for(model)
    state = slice_state_dict(model.state_dict(), plan, mapping.layers)
    cfg = pruned_config(model.config, plan)
    param = next(model.parameters())
    with no_init_weights():  # every tensor is loaded below; skip the random init
        new = type(model)._from_config(cfg, dtype=param.dtype)
    prepare_model(new)  # stacked experts -> per-expert Linears, the names `state` has
    new.tie_weights()
    missing, unexpected = new.load_state_dict(state, strict=False)
    tied = set(getattr(new, "all_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    assert not missing and not unexpected, (
        f"pruned state dict mismatch: {missing[:3]} {unexpected[:3]}"
    )
    if getattr(model, "generation_config", None) is not None:
        new.generation_config = copy.deepcopy(model.generation_config)
    return new.to(param.device).eval()


def expected_parameters(dims: Dims, vocab_size: int, tied: bool, config=None) -> int:
    """Parameters a Llama of shape `dims` has: what config.json promises the checkpoint holds.

    Counts biases of q/k/v/o (attention_bias) and of the MLP (mlp_bias) when `config` has them.
    """
    h, f, d = dims.hidden_size, dims.intermediate_size, dims.head_dim
    q, kv = dims.num_attention_heads * d, dims.num_key_value_heads * d
    attn_bias = bool(getattr(config, "attention_bias", False))
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv + h if attn_bias else 0)
    mlp = 3 * h * f + (2 * f + h if mlp_bias else 0)
    per_layer = attn + mlp + 2 * h  # + two RMSNorm weights
    embeddings = vocab_size * h * (1 if tied else 2)
    return dims.num_layers * per_layer + embeddings + h  # + final norm
