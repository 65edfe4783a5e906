"""Structured pruning of mixture-of-experts blocks: which experts a sparse layer keeps, which
FFN channels each kept expert keeps, how their tensors are sliced and how the config follows.

Per sparse layer the `expert_method` score ranks the experts (`weight`: the routing weight each
got on the calibration tokens, the sum of the router's top-k weights as the architecture
computes them; `frequency`: the tokens routed to it); ties, e.g. experts no token reached, go by
the router probability summed over every token, then by the lower index. Every sparse layer keeps
the same number of experts (a config holds one count), each its own ones, renumbered 0..E'-1 in
their old order; the router loses the rows of the experts that went, so it routes over the kept
ones with the architecture's own top-k (never changed). Each kept expert keeps its best
`moe_intermediate_size` channels. Qwen2-MoE's shared expert and its gate are never pruned except
along hidden channels.

Tensor layouts in a sparse block (HF Linear weights are [out_features, in_features]; names as on
disk, runtime/loading/moe_experts.py `MOE_LAYOUTS`):
  gate (the router) [E, H]   experts.e.{gate,up} [I, H]   experts.e.down [H, I]
  shared_expert.{gate_proj,up_proj} [S, H]   shared_expert.down_proj [H, S]   shared_expert_gate [1, H]
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slimserve.compress.prune.importance import ExpertScores
from slimserve.compress.prune.sizes import MoeDims
from slimserve.runtime.loading.moe_experts import MOE_LAYOUTS
from slimserve.runtime.models.moe import moe_spec

EXPERT_METHODS = ("weight", "frequency")


def expert_ranking(scores: ExpertScores, method: str) -> list[int]:
    """Expert indices of one sparse layer, most important first (see the module docstring)."""
    if not scores.measured:
        raise ValueError("expert scores without routing statistics; run activation_importance")
    if method not in EXPERT_METHODS:
        raise ValueError(f"expert_method={method!r}; use one of {', '.join(EXPERT_METHODS)}")
    primary = (scores.weight if method == "weight" else scores.counts).tolist()
    prob = scores.prob.tolist()
    return sorted(range(len(primary)), key=lambda e: (-primary[e], -prob[e], e))


def choose_experts(scores: ExpertScores, keep: int, method: str) -> tuple[int, ...]:
    """The `keep` most important experts of a layer, ascending (old indices)."""
    return tuple(sorted(expert_ranking(scores, method)[:keep]))


@dataclass(frozen=True, slots=True)
class BlockRule:
    """How one sparse-block tensor is sliced: kinds per dim ('experts', 'ech' = the expert's
    channels, 'h' = hidden) and, for a per-expert tensor, the expert's old index."""

    rule: tuple[str | None, str | None]
    expert: int | None = None
    rest: str = ""  # the name after 'experts.<e>.' (per-expert tensors)


def block_rule(rel: str, model_type: str) -> BlockRule | None:
    """The slicing rule of a tensor named `rel` inside a decoder layer, when it belongs to the
    sparse block of a `model_type` model; None otherwise."""
    layout = MOE_LAYOUTS.get(model_type)
    if layout is None or not rel.startswith(layout.disk_block + "."):
        return None
    name = rel[len(layout.disk_block) + 1 :]
    g, u, d = layout.proj
    m = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", name)
    if m:
        proj = m.group(2)
        rule = ("ech", "h") if proj in (g, u) else ("h", "ech") if proj == d else None
        return None if rule is None else BlockRule(rule, int(m.group(1)), f"{proj}.weight")
    fixed = {
        "gate.weight": ("experts", "h"),
        "shared_expert.gate_proj.weight": (None, "h"),
        "shared_expert.up_proj.weight": (None, "h"),
        "shared_expert.down_proj.weight": ("h", None),
        "shared_expert_gate.weight": (None, "h"),
    }
    return BlockRule(fixed[name]) if name in fixed else None


def expert_key(model_type: str, new_index: int, rest: str) -> str:
    """The name (in its layer) of a per-expert tensor once its expert is renumbered `new_index`."""
    block = MOE_LAYOUTS[model_type].disk_block
    return f"{block}.experts.{new_index}.{rest}"


def sparse_pattern_fields(config, sparse: list[bool]) -> dict:
    """The config fields that make the layers sparse exactly where `sparse` says (Qwen3-MoE and
    Qwen2-MoE; their `decoder_sparse_step` / `mlp_only_layers`), {} when the config already does."""
    cfg_sparse = list(moe_spec(config, len(sparse)).sparse_layers)
    if cfg_sparse == sparse:
        return {}
    if config.model_type not in ("qwen3_moe", "qwen2_moe"):  # all layers sparse, always
        raise ValueError(f"{config.model_type} has no dense layers to keep")
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, s in enumerate(sparse) if not s]}


def resize_moe_config(cfg, before: MoeDims, after: MoeDims, kept_layers) -> None:
    """Write `after`'s expert count and width into `cfg` (in place), and the sparse/dense layout
    of the kept layers (old indices `kept_layers`)."""
    cfg.num_experts = after.num_experts  # num_local_experts through the config's attribute_map
    setattr(cfg, after.width_key, after.intermediate_size)
    sparse = [before.sparse_layers[i] for i in kept_layers]
    for key, value in sparse_pattern_fields(cfg, sparse).items():
        setattr(cfg, key, value)


def expert_parameters(config) -> dict[str, int]:
    """Parameters of the sparse blocks `config` describes: routers, experts, shared experts."""
    moe = MoeDims.from_config(config)
    if moe is None:
        return {"routers": 0, "experts": 0, "shared": 0}
    h, sparse = config.hidden_size, sum(moe.sparse_layers)
    shared = getattr(config, "shared_expert_intermediate_size", 0) or 0
    shared = 3 * h * shared + h if config.model_type == "qwen2_moe" else 0
    return {
        "routers": sparse * moe.num_experts * h,
        "experts": sparse * moe.num_experts * 3 * h * moe.intermediate_size,
        "shared": sparse * shared,
    }


def describe_experts(
    before: MoeDims, after: MoeDims, scores: list[ExpertScores | None], kept: dict, method: str
) -> dict:
    """Report facts: per sparse layer the experts kept and removed with their measured routing
    share (tokens routed / tokens), weight (mean routing weight per token) and tokens."""
    rows = []
    for layer, sc in enumerate(scores):
        if sc is None or layer not in kept:
            continue
        row = {"layer": layer, "kept": list(kept[layer])}
        row["removed"] = [e for e in range(before.num_experts) if e not in kept[layer]]
        if sc.measured:
            t = max(sc.tokens, 1)
            row["tokens"] = sc.tokens
            row["routed_tokens"] = [int(x) for x in sc.counts]
            row["frequency"] = [round(float(x) / t, 6) for x in sc.counts]
            row["weight"] = [round(float(x) / t, 6) for x in sc.weight]
            row["router_prob"] = [round(float(x) / t, 6) for x in sc.prob]
            row["kept_frequency"] = round(
                sum(row["frequency"][e] for e in row["kept"]) / before.top_k, 6
            )
            row["kept_weight"] = round(
                sum(row["weight"][e] for e in row["kept"]) / max(sum(row["weight"]), 1e-12), 6
            )
        if sc.channels_from_all_tokens:
            row["channels_from_all_tokens"] = list(sc.channels_from_all_tokens)
        rows.append(row)
    return {
        "method": method,
        "num_experts": {"before": before.num_experts, "after": after.num_experts},
        "num_experts_per_tok": before.top_k,
        "moe_intermediate_size": {
            "before": before.intermediate_size,
            "after": after.intermediate_size,
        },
        "per_layer": rows,
    }
