"""Importance scores for structured pruning: higher = keep.

`activation` (Minitron, Muralidharan et al. 2024): one layer-sequential pass over the calibration
windows; per layer, the mean |activation| of each MLP channel (the input of down_proj), the mean
L2 norm of each attention head's output (the input of o_proj, per head), and the mean |output|
of the layer's two RMSNorms per hidden channel (summed over layers). The same pass gives each
layer's Block Influence, 1 - cos(layer input, layer output) averaged over tokens (ShortGPT): a
layer that barely changes its input is the cheapest to drop.

`magnitude` needs no data: the L2 norm of every weight that reads or writes a channel or head
(norm gains folded into the Linears they feed).

`layer_perplexity_scores`: the increase in calibration NLL when one layer is skipped.

Mixture-of-experts layers (`ExpertScores`, per sparse layer): the same pass hooks the router and
the block's `ExpertList` (runtime/loading/moe_experts.py) and counts, per expert, the tokens
routed to it, the routing weight it received (the sum of the top-k weights, as the architecture
computes them) and its router probability summed over all tokens (a tie-breaker for experts no
token reached). Each expert's FFN channels score as a dense MLP's do (mean |down_proj input|),
over the tokens routed to it; with `all_experts` every expert also runs on every token (its
output still routed, compress/moe.py `all_experts`), and an expert that got fewer than
MIN_EXPERT_TOKENS routed tokens scores its channels on all of them instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slimserve.compress.calibration import capture_first_layer_inputs
from slimserve.compress.mappings import decoder_layers, mapping_for
from slimserve.compress.moe import MIN_EXPERT_TOKENS, all_experts
from slimserve.compress.prune.sizes import Dims
from slimserve.compress.stage import LayerContext, LayerInputs
from slimserve.runtime.loading.moe_experts import MOE_LAYOUTS, ExpertList


@dataclass(slots=True)
class ExpertScores:
    """One sparse layer's experts: routing statistics and per-expert FFN channel scores."""

    channels: torch.Tensor  # [E, I] per expert FFN channel (higher = keep)
    tokens: int = 0  # calibration tokens through the block (0: routing not measured)
    counts: torch.Tensor | None = None  # [E] tokens routed to each expert
    weight: torch.Tensor | None = None  # [E] sum of the top-k routing weights each expert got
    prob: torch.Tensor | None = None  # [E] router probability summed over every token
    channels_from_all_tokens: tuple[int, ...] = ()  # experts whose channels scored on all tokens

    @property
    def measured(self) -> bool:
        return self.counts is not None


@dataclass(slots=True)
class Importance:
    heads: torch.Tensor  # [L, n_q] per query head
    channels: torch.Tensor  # [L, F] per MLP channel (zeros in sparse layers)
    hidden: torch.Tensor  # [H] per hidden channel
    layers: torch.Tensor | None  # [L] per decoder layer (None: not measured)
    method: str  # 'activation' | 'magnitude'
    # per decoder layer: its experts' scores, None for a dense layer (None: a dense model)
    experts: list[ExpertScores | None] | None = field(default=None)


def head_norms(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per-head L2 norm of an attention output. x [..., num_heads * head_dim] -> [..., num_heads]."""
    return x.unflatten(-1, (num_heads, -1)).float().norm(dim=-1)


def block_influence(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """1 - cos(h_in, h_out) per token. [..., H] x2 -> [...]: 0 = the layer changed nothing."""
    return 1.0 - F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)


def channel_abs_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of |x| per channel. x [..., C] -> [C] float32 on the CPU."""
    return x.detach().abs().float().sum(dim=tuple(range(x.dim() - 1))).cpu()


def _dense_mlp(layer: nn.Module) -> nn.Module | None:
    """The layer's dense MLP (one with down_proj), None in a sparse layer."""
    mlp = layer._modules.get("mlp")
    return mlp if hasattr(mlp, "down_proj") and not hasattr(mlp, "experts") else None


def sparse_block(layer: nn.Module, model_type: str | None) -> nn.Module | None:
    """The layer's sparse block with per-expert Linears (compress/moe.py), None in a dense one."""
    layout = MOE_LAYOUTS.get(model_type)
    if layout is None:
        return None
    block = layer._modules.get(layout.disk_block)
    return block if isinstance(getattr(block, "experts", None), ExpertList) else None


class _ExpertStats:
    """Routing counts and per-expert channel sums of one sparse block, filled by hooks."""

    def __init__(self, block: nn.Module):
        experts: ExpertList = block.experts
        num = len(experts)
        width = experts[0].linears()[2].in_features
        self.tokens = 0
        self.counts = torch.zeros(num)
        self.weight = torch.zeros(num)
        self.prob = torch.zeros(num)
        self.routed_sum = torch.zeros(num, width)  # [E, I] |down input| over routed tokens
        self.all_sum = torch.zeros(num, width)  # [E, I] over every token (all-expert runs)
        self.all_tokens = 0  # tokens in all_sum (per expert, the same)
        self._routed: torch.Tensor | None = None  # [T, E] bool of the current call
        self.handles = [
            block.gate.register_forward_hook(self._router),
            experts.register_forward_pre_hook(self._route, with_kwargs=True),
        ]
        for e, expert in enumerate(experts):
            self.handles.append(
                expert.linears()[2].register_forward_pre_hook(
                    lambda m, a, e=e, lst=experts: self._down(a[0], e, lst.calibrate_all)
                )
            )

    def _router(self, _m, _args, out) -> None:
        logits = out[0] if isinstance(out, tuple) else out  # [T, E]
        probs = torch.softmax(logits.detach().float(), dim=-1)
        self.prob += probs.reshape(-1, probs.size(-1)).sum(dim=0).cpu()

    def _route(self, _m, args, kwargs) -> None:
        names = ("hidden_states", "top_k_index", "top_k_weights")
        vals = list(args) + [kwargs[n] for n in names[len(args) :]]
        index, weights = vals[1].detach().cpu(), vals[2].detach().float().cpu()  # [T, k]
        num = self.counts.numel()
        self.tokens += index.size(0)
        routed = torch.zeros(index.size(0), num, dtype=torch.bool)
        routed.scatter_(1, index, True)
        self._routed = routed
        self.counts += routed.sum(dim=0).float()
        self.weight.scatter_add_(0, index.reshape(-1), weights.reshape(-1))

    def _down(self, x: torch.Tensor, e: int, every_token: bool) -> None:
        x = x.detach()
        if every_token:  # x holds every token of the call, in order
            self.all_sum[e] += channel_abs_sum(x)
            if e == 0:
                self.all_tokens += x.size(0)
            x = x[self._routed[:, e].to(x.device)]
        self.routed_sum[e] += channel_abs_sum(x)

    def scores(self) -> ExpertScores:
        channels, fallback = torch.zeros_like(self.routed_sum), []
        for e in range(self.counts.numel()):
            n = int(self.counts[e])
            if n < MIN_EXPERT_TOKENS and self.all_tokens:
                channels[e] = self.all_sum[e] / self.all_tokens
                fallback.append(e)
            elif n:
                channels[e] = self.routed_sum[e] / n
        return ExpertScores(
            channels, self.tokens, self.counts, self.weight, self.prob, tuple(fallback)
        )

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class _LayerStats:
    """Sums over calibration tokens for one decoder layer, filled by forward hooks."""

    def __init__(self, layer: nn.Module, num_heads: int, model_type: str | None = None):
        self.tokens = 0  # tokens seen by the attention hook (each batch counted once)
        self.channels = 0.0  # [F] sum of |down_proj input| (dense MLP layers)
        self.heads = 0.0  # [n_q] sum of per-head L2 norms of the o_proj input
        self.hidden = 0.0  # [H] sum of |norm output| over both norms
        self.handles = [
            layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a: self._heads(a[0], num_heads)
            ),
            layer.input_layernorm.register_forward_hook(self._norm),
            layer.post_attention_layernorm.register_forward_hook(self._norm),
        ]
        mlp = _dense_mlp(layer)
        if mlp is not None:
            self.handles.append(mlp.down_proj.register_forward_pre_hook(self._mlp))
        block = sparse_block(layer, model_type)
        self.experts = _ExpertStats(block) if block is not None else None

    def _mlp(self, _m, args) -> None:
        self.channels = self.channels + channel_abs_sum(args[0])

    def _heads(self, x: torch.Tensor, num_heads: int) -> None:
        n = head_norms(x.detach(), num_heads)  # [b, t, n_q]
        self.tokens += n[..., 0].numel()
        self.heads = self.heads + n.sum(dim=tuple(range(n.dim() - 1))).cpu()

    def _norm(self, _m, _args, out) -> None:
        self.hidden = self.hidden + channel_abs_sum(out)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        if self.experts is not None:
            self.experts.remove()


@torch.no_grad()
def activation_importance(
    model: nn.Module,
    batches: list[torch.Tensor],
    device: torch.device | str = "cpu",
    on_layer=None,
    every_expert: bool = False,
) -> Importance:
    """Minitron activation scores and Block Influence from calibration batches [b, seq_len] of ids.

    Runs layer-sequentially (one decoder layer on `device` at a time), like the quantizers. On a
    mixture-of-experts model each sparse layer also gets its `ExpertScores`; `every_expert` runs
    every expert on every token while the layer's output stays routed (for experts' channels).
    """
    device = torch.device(device)
    mapping = mapping_for(model)
    dims = Dims.from_config(model.config)
    model_type = getattr(model.config, "model_type", None)
    moe = model_type in MOE_LAYOUTS
    inputs = capture_first_layer_inputs(model, mapping, batches, device)
    heads, channels, hidden, influence, experts = [], [], 0.0, [], []
    layers = decoder_layers(model, mapping)
    for i, layer in enumerate(layers):
        layer.to(device)
        stats = _LayerStats(layer, dims.num_attention_heads, model_type)
        # LayerContext only replays cached inputs here; no CompressionState is involved.
        ctx = LayerContext(i, f"{mapping.layers}.{i}", layer, inputs, mapping, None, device)
        try:
            with all_experts(layer, every_expert):
                outs = ctx.forward()
        finally:
            stats.remove()
        bi = sum(block_influence(h, o).sum().item() for h, o in zip(inputs.hidden, outs))
        influence.append(bi / stats.tokens)
        heads.append(stats.heads / stats.tokens)
        dense = stats.channels if torch.is_tensor(stats.channels) else None
        channels.append(
            dense / stats.tokens if dense is not None else torch.zeros(dims.intermediate_size)
        )
        experts.append(stats.experts.scores() if stats.experts is not None else None)
        hidden = hidden + stats.hidden / stats.tokens
        inputs = LayerInputs(outs, inputs.kwargs)
        layer.to("cpu")
        if on_layer:
            on_layer(i + 1, len(layers))
    return Importance(
        torch.stack(heads),
        torch.stack(channels),
        hidden,
        torch.tensor(influence),
        "activation",
        experts if moe else None,
    )


def _col_norm2(w: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each input column. w [out, in] -> [in]."""
    return w.float().pow(2).sum(dim=0)


def _row_norm2(w: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each output row. w [out, in] -> [out]."""
    return w.float().pow(2).sum(dim=1)


def mlp_channel_magnitude(gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    """Per FFN channel, the L2 norm of the weights that write it (gate/up rows) and read it
    (down columns). [F]"""
    ch = _row_norm2(gate.weight) + _row_norm2(up.weight) + _col_norm2(down.weight)
    return ch.sqrt()


def _mlp_hidden_norms(mlps: list[tuple[nn.Linear, nn.Linear, nn.Linear]]):
    """(reads [H], writes [H]): squared column norms of the gate/up and row norms of the down
    Linears of `mlps`, summed."""
    reads = sum(_col_norm2(g.weight) + _col_norm2(u.weight) for g, u, _ in mlps)
    writes = sum(_row_norm2(d.weight) for _, _, d in mlps)
    return reads, writes


@torch.no_grad()
def magnitude_importance(model: nn.Module) -> Importance:
    """Data-free scores: L2 norm of every weight touching a head / channel (no layer scores; in
    a mixture of experts, each expert's channels, but no routing statistics)."""
    mapping = mapping_for(model)
    dims = Dims.from_config(model.config)
    model_type = getattr(model.config, "model_type", None)
    n_q = dims.num_attention_heads
    heads, channels, experts = [], [], []
    hidden = _col_norm2(model.get_input_embeddings().weight)  # [H] embedding columns
    out_emb = model.get_output_embeddings()
    final_norm = model.model.norm.weight.float()
    hidden = hidden + _col_norm2(out_emb.weight) * final_norm.pow(2)
    for layer in decoder_layers(model, mapping):
        attn = layer.self_attn
        q_rows = _row_norm2(attn.q_proj.weight).view(n_q, -1).sum(dim=1)  # [n_q]
        o_cols = _col_norm2(attn.o_proj.weight).view(n_q, -1).sum(dim=1)  # [n_q]
        heads.append((q_rows + o_cols).sqrt())
        mlp, block = _dense_mlp(layer), sparse_block(layer, model_type)
        if mlp is not None:
            lins = [(mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
            channels.append(mlp_channel_magnitude(*lins[0]))  # [F]
            experts.append(None)
        else:
            lins = [e.linears() for e in block.experts]
            shared = block._modules.get("shared_expert")
            if shared is not None:
                lins.append((shared.gate_proj, shared.up_proj, shared.down_proj))
            channels.append(torch.zeros(dims.intermediate_size))
            experts.append(
                ExpertScores(
                    torch.stack([mlp_channel_magnitude(*e.linears()) for e in block.experts])
                )
            )
        g_attn = layer.input_layernorm.weight.float().pow(2)  # norm gains scale what q/k/v read
        g_mlp = layer.post_attention_layernorm.weight.float().pow(2)
        reads_attn = sum(_col_norm2(p.weight) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        reads_mlp, writes_mlp = _mlp_hidden_norms(lins)
        if block is not None:  # the router reads the same normed input
            reads_mlp = reads_mlp + _col_norm2(block.gate.weight)
        writes = _row_norm2(attn.o_proj.weight) + writes_mlp
        hidden = hidden + reads_attn * g_attn + reads_mlp * g_mlp + writes
    return Importance(
        torch.stack(heads),
        torch.stack(channels),
        hidden.sqrt(),
        None,
        "magnitude",
        experts if model_type in MOE_LAYOUTS else None,
    )


def _skip_layer(_m, args, kwargs, _out):
    """Forward hook: the layer returns its input unchanged."""
    return args[0] if args else kwargs["hidden_states"]


@torch.no_grad()
def mean_nll(model: nn.Module, batches: list[torch.Tensor]) -> float:
    """Mean next-token NLL (nats) of `model` over batches [b, seq_len] of ids."""
    total, count = 0.0, 0
    device = next(model.parameters()).device
    for ids in batches:
        ids = ids.to(device)
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [b, t-1, V]
        total += F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
        count += ids[:, 1:].numel()
    return total / count


def layer_perplexity_scores(
    model: nn.Module, batches: list[torch.Tensor], on_layer=None
) -> torch.Tensor:
    """Per layer, the calibration NLL increase (nats) when that layer is skipped. [L]"""
    layers = decoder_layers(model, mapping_for(model))
    was_training = model.training
    model.eval()
    base = mean_nll(model, batches)
    scores = []
    for i, layer in enumerate(layers):
        handle = layer.register_forward_hook(_skip_layer, with_kwargs=True)
        try:
            scores.append(mean_nll(model, batches) - base)
        finally:
            handle.remove()
        if on_layer:
            on_layer(i + 1, len(layers))
    model.train(was_training)
    return torch.tensor(scores)
