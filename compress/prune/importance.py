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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from slimserve.compress.calibration import capture_first_layer_inputs
from slimserve.compress.mappings import decoder_layers, mapping_for
from slimserve.compress.prune.sizes import Dims
from slimserve.compress.stage import LayerContext, LayerInputs


@dataclass(slots=True)
class Importance:
    heads: torch.Tensor  # [L, n_q] per query head
    channels: torch.Tensor  # [L, F] per MLP channel
    hidden: torch.Tensor  # [H] per hidden channel
    layers: torch.Tensor | None  # [L] per decoder layer (None: not measured)
    method: str  # 'activation' | 'magnitude'


def head_norms(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Per-head L2 norm of an attention output. x [..., num_heads * head_dim] -> [..., num_heads]."""
    return x.unflatten(-1, (num_heads, -1)).float().norm(dim=-1)


def block_influence(h_in: torch.Tensor, h_out: torch.Tensor) -> torch.Tensor:
    """1 - cos(h_in, h_out) per token. [..., H] x2 -> [...]: 0 = the layer changed nothing."""
    return 1.0 - F.cosine_similarity(h_in.float(), h_out.float(), dim=-1)


class _LayerStats:
    """Sums over calibration tokens for one decoder layer, filled by forward hooks."""

    def __init__(self, layer: nn.Module, num_heads: int):
        self.tokens = 0  # tokens seen by the MLP hook (each batch counted once)
        self.channels = 0.0  # [F] sum of |down_proj input|
        self.heads = 0.0  # [n_q] sum of per-head L2 norms of the o_proj input
        self.hidden = 0.0  # [H] sum of |norm output| over both norms
        self.handles = [
            layer.mlp.down_proj.register_forward_pre_hook(self._mlp),
            layer.self_attn.o_proj.register_forward_pre_hook(
                lambda m, a: self._heads(a[0], num_heads)
            ),
            layer.input_layernorm.register_forward_hook(self._norm),
            layer.post_attention_layernorm.register_forward_hook(self._norm),
        ]

    def _mlp(self, _m, args) -> None:
        x = args[0].detach()  # [b, t, F]
        self.tokens += x[..., 0].numel()
        self.channels = self.channels + x.abs().float().sum(dim=tuple(range(x.dim() - 1))).cpu()

    def _heads(self, x: torch.Tensor, num_heads: int) -> None:
        n = head_norms(x.detach(), num_heads)  # [b, t, n_q]
        self.heads = self.heads + n.sum(dim=tuple(range(n.dim() - 1))).cpu()

    def _norm(self, _m, _args, out) -> None:
        y = out.detach()  # [b, t, H]
        self.hidden = self.hidden + y.abs().float().sum(dim=tuple(range(y.dim() - 1))).cpu()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@torch.no_grad()
def activation_importance(
    model: nn.Module, batches: list[torch.Tensor], device: torch.device | str = "cpu", on_layer=None
) -> Importance:
    """Minitron activation scores and Block Influence from calibration batches [b, seq_len] of ids.

    Runs layer-sequentially (one decoder layer on `device` at a time), like the quantizers.
    """
    device = torch.device(device)
    mapping = mapping_for(model)
    dims = Dims.from_config(model.config)
    inputs = capture_first_layer_inputs(model, mapping, batches, device)
    heads, channels, hidden, influence = [], [], 0.0, []
    layers = decoder_layers(model, mapping)
    for i, layer in enumerate(layers):
        layer.to(device)
        stats = _LayerStats(layer, dims.num_attention_heads)
        # LayerContext only replays cached inputs here; no CompressionState is involved.
        ctx = LayerContext(i, f"{mapping.layers}.{i}", layer, inputs, mapping, None, device)
        try:
            outs = ctx.forward()
        finally:
            stats.remove()
        bi = sum(block_influence(h, o).sum().item() for h, o in zip(inputs.hidden, outs))
        influence.append(bi / stats.tokens)
        heads.append(stats.heads / stats.tokens)
        channels.append(stats.channels / stats.tokens)
        hidden = hidden + stats.hidden / stats.tokens
        inputs = LayerInputs(outs, inputs.kwargs)
        layer.to("cpu")
        if on_layer:
            on_layer(i + 1, len(layers))
    return Importance(
        torch.stack(heads), torch.stack(channels), hidden, torch.tensor(influence), "activation"
    )


def _col_norm2(w: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each input column. w [out, in] -> [in]."""
    return w.float().pow(2).sum(dim=0)


def _row_norm2(w: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm of each output row. w [out, in] -> [out]."""
    return w.float().pow(2).sum(dim=1)


@torch.no_grad()
def magnitude_importance(model: nn.Module) -> Importance:
    """Data-free scores: L2 norm of every weight touching a head / channel (no layer scores)."""
    mapping = mapping_for(model)
    dims = Dims.from_config(model.config)
    n_q = dims.num_attention_heads
    heads, channels = [], []
    hidden = _col_norm2(model.get_input_embeddings().weight)  # [H] embedding columns
    out_emb = model.get_output_embeddings()
    final_norm = model.model.norm.weight.float()
    hidden = hidden + _col_norm2(out_emb.weight) * final_norm.pow(2)
    for layer in decoder_layers(model, mapping):
        attn, mlp = layer.self_attn, layer.mlp
        q_rows = _row_norm2(attn.q_proj.weight).view(n_q, -1).sum(dim=1)  # [n_q]
        o_cols = _col_norm2(attn.o_proj.weight).view(n_q, -1).sum(dim=1)  # [n_q]
        heads.append((q_rows + o_cols).sqrt())
        ch = (
            _row_norm2(mlp.gate_proj.weight)
            + _row_norm2(mlp.up_proj.weight)
            + _col_norm2(mlp.down_proj.weight)
        )
        channels.append(ch.sqrt())  # [F]
        g_attn = layer.input_layernorm.weight.float().pow(2)  # norm gains scale what q/k/v read
        g_mlp = layer.post_attention_layernorm.weight.float().pow(2)
        reads_attn = sum(_col_norm2(p.weight) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        reads_mlp = _col_norm2(mlp.gate_proj.weight) + _col_norm2(mlp.up_proj.weight)
        writes = _row_norm2(attn.o_proj.weight) + _row_norm2(mlp.down_proj.weight)
        hidden = hidden + reads_attn * g_attn + reads_mlp * g_mlp + writes
    return Importance(torch.stack(heads), torch.stack(channels), hidden.sqrt(), None, "magnitude")


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
