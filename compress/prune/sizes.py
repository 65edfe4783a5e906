"""Pruning targets -> the model's shape after pruning (`Dims`), or a refusal naming the key.

A recipe gives each dimension either as an amount removed (`heads`, `mlp`, `hidden`: a fraction
in [0, 1); `layers`: a count, or a fraction when below 1) or as the absolute size it keeps, under
the Hugging Face config names (`num_attention_heads`, `num_key_value_heads`, `intermediate_size`,
`hidden_size`, `num_layers`). Channel sizes are multiples of `multiple_of` (default 64, so group
size 128 quantization and the GEMM kernels' tiles still fit): fractions round to the nearest
multiple, absolute sizes must already be one. The hidden size is also a multiple of the number of
query heads kept, which transformers 5's LlamaConfig requires even with an explicit head_dim.
Attention keeps grouped-query attention intact: `num_attention_heads` stays a multiple of
`num_key_value_heads`, with the same number of query heads in every KV group.

Mixture-of-experts models (`MoeDims`) add two: whole experts per sparse layer (`experts`: a
fraction removed, or `num_experts` kept; never fewer than the router's top-k) and each expert's
FFN channels (`expert_mlp`: a fraction removed, or `moe_intermediate_size` kept, a multiple of
`multiple_of`). Every sparse layer keeps the same expert count and width, since a config holds one.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from slimserve.compress.errors import RecipeError
from slimserve.runtime.models.moe import moe_spec

KEY = "prune"  # prefix of the recipe keys named in error messages


@dataclass(frozen=True, slots=True)
class Dims:
    """The shape of a Llama-family decoder (every layer alike)."""

    hidden_size: int  # model width (embedding channels)
    intermediate_size: int  # MLP channels per layer
    num_attention_heads: int  # query heads per layer
    num_key_value_heads: int  # key/value heads per layer (GQA groups)
    head_dim: int  # channels per head (never pruned)
    num_layers: int  # decoder layers

    @classmethod
    def from_config(cls, config) -> Dims:
        heads = config.num_attention_heads
        return cls(
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_attention_heads=heads,
            num_key_value_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            num_layers=config.num_hidden_layers,
        )

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Targets:
    """What a recipe asks for; None = not given. Amounts are removed, sizes are kept."""

    heads: float | None = None  # fraction of attention heads removed, [0, 1)
    mlp: float | None = None  # fraction of MLP channels removed, [0, 1)
    hidden: float | None = None  # fraction of hidden (embedding) channels removed, [0, 1)
    layers: float | int | None = None  # decoder layers removed: a count (int), or a fraction < 1
    num_attention_heads: int | None = None  # query heads kept per layer
    num_key_value_heads: int | None = None  # KV heads kept per layer
    intermediate_size: int | None = None  # MLP channels kept per layer
    hidden_size: int | None = None  # hidden channels kept
    num_layers: int | None = None  # decoder layers kept
    heads_mode: str = "query"  # 'query': query heads evenly per KV group; 'kv_groups': whole groups
    multiple_of: int = 64  # channel sizes (mlp, hidden, expert_mlp) are multiples of this
    experts: float | None = None  # fraction of each sparse layer's experts removed, [0, 1)
    num_experts: int | None = None  # experts kept per sparse layer
    expert_mlp: float | None = None  # fraction of each expert's FFN channels removed, [0, 1)
    moe_intermediate_size: int | None = None  # FFN channels kept per expert

    @property
    def touches_experts(self) -> bool:
        return any(
            v is not None
            for v in (self.experts, self.num_experts, self.expert_mlp, self.moe_intermediate_size)
        )


@dataclass(frozen=True, slots=True)
class MoeDims:
    """The sparse blocks of a mixture-of-experts model (every sparse layer alike)."""

    model_type: str  # qwen3_moe, qwen2_moe, mixtral or olmoe (runtime/loading/moe_experts.py)
    num_experts: int  # experts per sparse layer (config num_experts / num_local_experts)
    top_k: int  # experts each token is routed to (num_experts_per_tok, never pruned)
    intermediate_size: int  # FFN channels of one expert
    sparse_layers: tuple[bool, ...]  # per decoder layer: a sparse block (True) or a dense MLP

    @classmethod
    def from_config(cls, config) -> MoeDims | None:
        """None for a dense model."""
        spec = moe_spec(config, config.num_hidden_layers)
        if spec is None:
            return None
        return cls(
            model_type=config.model_type,
            num_experts=spec.num_experts,
            top_k=spec.top_k,
            intermediate_size=spec.intermediate_size,
            sparse_layers=spec.sparse_layers,
        )

    @property
    def width_key(self) -> str:
        """The config field holding an expert's width: Mixtral and OLMoE have no dense MLP, so
        their `intermediate_size` is the experts' width."""
        return (
            "intermediate_size"
            if self.model_type in ("mixtral", "olmoe")
            else ("moe_intermediate_size")
        )

    @property
    def has_dense_layers(self) -> bool:
        return not all(self.sparse_layers)

    def to_dict(self) -> dict:
        return {
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "moe_intermediate_size": self.intermediate_size,
        }


def resolve_dims(dims: Dims, t: Targets) -> Dims:
    """The shape after pruning `dims` as `t` asks; RecipeError (naming the key) if impossible."""
    if t.multiple_of < 1:
        raise RecipeError(
            f"{KEY}.multiple_of={t.multiple_of}; use a positive channel multiple such as 64"
        )
    heads, kv = _resolve_heads(dims, t)
    # transformers 5 refuses a Llama config whose hidden_size is not a multiple of
    # num_attention_heads even when head_dim is explicit, so hidden sizes step by both.
    step = math.lcm(t.multiple_of, heads)
    hidden = _resolve_channels(
        dims.hidden_size, t.hidden, t.hidden_size, "hidden", "hidden_size", step
    )
    if hidden % heads:
        raise RecipeError(
            f"{KEY}: hidden_size {hidden} is not a multiple of num_attention_heads {heads}, "
            f"which transformers refuses to load; prune heads to a divisor of {hidden} "
            f"or use a hidden size that is a multiple of {step}"
        )
    return replace(
        dims,
        intermediate_size=_resolve_channels(
            dims.intermediate_size,
            t.mlp,
            t.intermediate_size,
            "mlp",
            "intermediate_size",
            t.multiple_of,
        ),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_layers=_resolve_layers(dims.num_layers, t.layers, t.num_layers),
    )


def _both(amount_key: str, size_key: str) -> RecipeError:
    return RecipeError(
        f"{KEY}.{amount_key} and {KEY}.{size_key} are both set; give the amount removed "
        f"or the size kept, not both"
    )


def _check_fraction(key: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise RecipeError(
            f"{KEY}.{key}={value} is not a fraction in [0, 1); give the share removed, "
            f"e.g. {key}: 0.25"
        )


def _resolve_channels(
    current: int,
    fraction: float | None,
    size: int | None,
    amount_key: str,
    size_key: str,
    multiple: int,
) -> int:
    """Channels kept: `size` as given (a multiple of `multiple`), or current*(1-fraction) rounded."""
    if fraction is not None and size is not None:
        raise _both(amount_key, size_key)
    if size is not None:
        if size == current:
            return size
        if not 0 < size < current:
            raise RecipeError(
                f"{KEY}.{size_key}={size} is not between 1 and the model's {current - 1}; "
                f"pruning only removes channels"
            )
        if size % multiple:
            lo, hi = size // multiple * multiple, (size // multiple + 1) * multiple
            near = " or ".join(str(v) for v in (lo, hi) if 0 < v < current)
            raise RecipeError(
                f"{KEY}.{size_key}={size} is not a multiple of {multiple} ({_why(size_key)}); "
                f"use {near or 'a multiple'} or change {KEY}.multiple_of"
            )
        return size
    if not fraction:
        if fraction is not None:
            _check_fraction(amount_key, fraction)
        return current
    _check_fraction(amount_key, fraction)
    if current < multiple:
        raise RecipeError(
            f"{KEY}.{amount_key}: the model's {size_key} {current} is below {multiple} "
            f"({_why(size_key)}); set a smaller {KEY}.multiple_of"
        )
    kept = max(multiple, round(current * (1.0 - fraction) / multiple) * multiple)
    kept = min(kept, current // multiple * multiple)  # a non-multiple current size never rounds up
    if kept >= current:
        need = multiple / current
        raise RecipeError(
            f"{KEY}.{amount_key}={fraction} removes no channel of {current} once rounded to "
            f"a multiple of {multiple} ({_why(size_key)}); use {amount_key} >= {need / 2:.3f} "
            f"or a smaller multiple_of"
        )
    return kept


def _why(size_key: str) -> str:
    if size_key == "hidden_size":
        return "multiple_of and the number of query heads kept"
    return "multiple_of"


def _resolve_heads(dims: Dims, t: Targets) -> tuple[int, int]:
    """(query heads, KV heads) kept, with the same number of query heads in every KV group."""
    n_q, n_kv, group = dims.num_attention_heads, dims.num_key_value_heads, dims.heads_per_group
    if t.heads_mode not in ("query", "kv_groups"):
        raise RecipeError(
            f"{KEY}.heads_mode={t.heads_mode!r}; use 'query' (query heads evenly per KV "
            f"group) or 'kv_groups' (whole KV groups with their query heads)"
        )
    absolute = t.num_attention_heads is not None or t.num_key_value_heads is not None
    if t.heads is not None and absolute:
        which = (
            "num_attention_heads" if t.num_attention_heads is not None else "num_key_value_heads"
        )
        raise _both("heads", which)
    if absolute:
        return _absolute_heads(dims, t.num_attention_heads, t.num_key_value_heads)
    if not t.heads:
        if t.heads is not None:
            _check_fraction("heads", t.heads)
        return n_q, n_kv
    _check_fraction("heads", t.heads)
    if t.heads_mode == "query" and group > 1:  # keep every KV head, fewer query heads per group
        per_group = max(1, round(group * (1.0 - t.heads)))
        if per_group == group:
            raise RecipeError(
                f"{KEY}.heads={t.heads} removes no head: {n_q} query heads in {n_kv} KV "
                f"groups of {group} lose heads evenly per group; use heads >= "
                f"{0.5 / group:.3f} or heads_mode: kv_groups"
            )
        return per_group * n_kv, n_kv
    kv = max(1, round(n_kv * (1.0 - t.heads)))  # whole groups (also plain multi-head attention)
    if kv == n_kv:
        raise RecipeError(
            f"{KEY}.heads={t.heads} removes no KV group of {n_kv} (heads_mode: kv_groups "
            f"removes whole groups); use heads >= {0.5 / n_kv:.3f}"
        )
    return kv * group, kv


def _absolute_heads(dims: Dims, heads: int | None, kv: int | None) -> tuple[int, int]:
    n_kv, group = dims.num_key_value_heads, dims.heads_per_group
    kv = n_kv if kv is None else kv
    if not 1 <= kv <= n_kv:
        raise RecipeError(f"{KEY}.num_key_value_heads={kv} is not between 1 and the model's {n_kv}")
    heads = kv * group if heads is None else heads
    if heads < 1 or heads % kv or heads // kv > group:
        raise RecipeError(
            f"{KEY}.num_attention_heads={heads} cannot keep grouped-query attention with {kv} KV heads "
            f"(the model has {group} query heads per group); use a multiple of {kv} up to {kv * group}"
        )
    return heads, kv


def _resolve_layers(current: int, layers: float | int | None, size: int | None) -> int:
    if layers is not None and size is not None:
        raise _both("layers", "num_layers")
    if size is not None:
        if not 1 <= size <= current:
            raise RecipeError(f"{KEY}.num_layers={size} is not between 1 and the model's {current}")
        return size
    if not layers:
        return current
    if isinstance(layers, float) and not float(layers).is_integer():
        _check_fraction("layers", layers)
        removed = round(current * layers)
        if removed == 0:
            raise RecipeError(
                f"{KEY}.layers={layers} removes no layer of {current}; use a count "
                f"(layers: 1) or a larger fraction"
            )
    else:
        removed = int(layers)
    if not 0 <= removed < current:
        raise RecipeError(
            f"{KEY}.layers={layers} would leave {current - removed} of {current} layers; "
            f"remove at most {current - 1}"
        )
    return current - removed


def resolve_moe(dims: Dims, moe: MoeDims | None, t: Targets) -> MoeDims | None:
    """The sparse blocks after pruning as `t` asks (None for a dense model); RecipeError (naming
    the key) for an expert target on a dense model, a dense-MLP target on a model without dense
    MLPs, head or hidden pruning where the architecture ties them to its norms, or impossible
    sizes."""
    if moe is None:
        if t.touches_experts:
            key = next(
                k
                for k in ("experts", "num_experts", "expert_mlp", "moe_intermediate_size")
                if getattr(t, k) is not None
            )
            raise RecipeError(
                f"{KEY}.{key}: the model has no experts (not a mixture of experts); use "
                f"heads / mlp / hidden / layers"
            )
        return None
    mt = moe.model_type
    dense_mlp = t.mlp or (t.intermediate_size not in (None, dims.intermediate_size))
    if dense_mlp and not moe.has_dense_layers:
        key = "mlp" if t.mlp else "intermediate_size"
        raise RecipeError(
            f"{KEY}.{key}: every layer of this {mt} model is a mixture of experts (no dense "
            f"MLP); prune the experts' channels with {KEY}.expert_mlp or "
            f"{KEY}.moe_intermediate_size"
        )
    if mt == "olmoe":
        heads = t.heads or t.num_attention_heads is not None or t.num_key_value_heads is not None
        for key, asked in (("heads", heads), ("hidden", t.hidden or t.hidden_size is not None)):
            if asked:
                raise RecipeError(
                    f"{KEY}.{key}: olmoe's q/k norms span every head and its head size is "
                    f"hidden_size / num_attention_heads, so its heads and hidden channels are not "
                    f"pruned; prune experts, expert_mlp or layers"
                )
    kept = _resolve_experts(moe, t.experts, t.num_experts)
    width = _resolve_channels(
        moe.intermediate_size,
        t.expert_mlp,
        t.moe_intermediate_size,
        "expert_mlp",
        "moe_intermediate_size",
        t.multiple_of,
    )
    return replace(moe, num_experts=kept, intermediate_size=width)


def _resolve_experts(moe: MoeDims, fraction: float | None, size: int | None) -> int:
    """Experts kept per sparse layer: `size`, or num_experts * (1 - fraction) rounded."""
    n, k = moe.num_experts, moe.top_k
    if fraction is not None and size is not None:
        raise _both("experts", "num_experts")
    if size is not None:
        if not 1 <= size <= n:
            raise RecipeError(
                f"{KEY}.num_experts={size} is not between 1 and the model's {n}; pruning "
                f"only removes experts"
            )
        kept, asked = size, f"{KEY}.num_experts={size}"
    elif fraction:
        _check_fraction("experts", fraction)
        kept, asked = round(n * (1.0 - fraction)), f"{KEY}.experts={fraction}"
        if kept == n:
            raise RecipeError(
                f"{asked} removes no expert of {n}; use experts >= {0.5 / n:.3f} or "
                f"num_experts: {n - 1}"
            )
    else:
        if fraction is not None:
            _check_fraction("experts", fraction)
        return n
    if kept < k:
        raise RecipeError(
            f"{asked} keeps {kept} of {n} experts, fewer than the {k} each token is routed "
            f"to (num_experts_per_tok); keep at least {k} (experts <= {1 - k / n:.3f})"
        )
    return kept
