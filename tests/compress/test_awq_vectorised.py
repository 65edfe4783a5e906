"""The vectorised AWQ searches choose exactly what straightforward loops choose.

`awq.py` quantizes every clip step in one batched call and measures the clip error through a
per-group factor of the inputs; the stage scores a mapping whose inspected module is its one
Linear through a factor of that Linear's inputs instead of replaying it. These tests hold them
to the plain formulations: a Python loop over shrink steps with the error summed over tokens,
and a loop over scale candidates that loads each candidate's weights and replays the submodule.
"""

import copy
import math

import pytest
import torch
from torch import nn

from slimserve.compress.quant.awq import (
    awq_clip_search,
    candidate_scale,
    fake_quantize,
    weight_group_absmean,
)
from slimserve.compress.quant.primitives import quantize_weight
from slimserve.runtime.artifact.scheme import QuantArgs


def _loop_fake_quantize(w: torch.Tensor, args: QuantArgs, sdt: torch.dtype) -> torch.Tensor:
    return quantize_weight(w.float(), args, sdt).dequantize(torch.float32)


def _loop_clip_search(w, x, args, sdt, n_grid=20, max_shrink=0.5):
    """One shrink step at a time, the group outputs x_g . w_g computed over every token."""
    n, k = w.shape
    g = args.group_size if args.strategy == "group" else k
    xg = x.double().reshape(-1, k // g, g)
    org_max = w.abs().reshape(n, k // g, g).amax(-1)
    ref = torch.einsum("tgc,ngc->ntg", xg, w.double().reshape(n, k // g, g))
    best_err, best_max = torch.full_like(org_max, math.inf, dtype=torch.float64), org_max.clone()
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1.0 - i / n_grid)
        lim = max_val.repeat_interleave(g, dim=1)
        q = _loop_fake_quantize(torch.clamp(w, -lim, lim), args, sdt).double()
        err = (torch.einsum("tgc,ngc->ntg", xg, q.reshape(n, k // g, g)) - ref).pow(2).mean(dim=1)
        better = err < best_err
        best_err, best_max = (
            torch.where(better, err, best_err),
            torch.where(better, max_val, best_max),
        )
    return best_max


ARGS = {
    "sym g32": QuantArgs(4, group_size=32),
    "asym g32": QuantArgs(4, group_size=32, symmetric=False),
    "int8 channel": QuantArgs(8, strategy="channel", group_size=None),
}


@pytest.mark.parametrize("name", ARGS)
@pytest.mark.parametrize("sdt", [torch.float32, torch.bfloat16])
def test_batched_fake_quantize_is_bit_identical_to_quantize_weight(name, sdt):
    args = ARGS[name]
    torch.manual_seed(0)
    w = torch.randn(3, 24, 96) * torch.rand(96) * 2
    w[0, 0, :32] = 0.0  # an all-zero group: the minimum scale
    out = fake_quantize(w, args, sdt)
    for i in range(3):
        assert torch.equal(out[i], _loop_fake_quantize(w[i], args, sdt))


@pytest.mark.parametrize("name", ["sym g32", "asym g32"])
@pytest.mark.parametrize(
    "tokens", [16, 300]
)  # fewer tokens than a group's columns (X itself), and more (QR)
@pytest.mark.parametrize("seed", range(3))
def test_vectorised_clip_search_picks_what_the_loop_picks(name, tokens, seed):
    args = ARGS[name]
    torch.manual_seed(seed)
    w = torch.randn(40, 96) * 0.1
    w[torch.rand_like(w) < 0.02] *= 12  # outliers worth clipping in some groups, not in others
    x = torch.randn(tokens, 96) * (1 + 5 * torch.rand(96))
    got = awq_clip_search(w, x, args, scale_dtype=torch.bfloat16)
    want = _loop_clip_search(w, x, args, torch.bfloat16)
    assert torch.equal(got, want)
    assert (got < w.abs().reshape(40, 3, 32).amax(-1)).any()  # the case does clip somewhere


def test_clip_search_chunks_rows_without_changing_the_result(monkeypatch):
    from slimserve.compress.quant import awq

    torch.manual_seed(0)
    w, x = torch.randn(64, 64), torch.randn(100, 64)
    whole = awq_clip_search(w, x, ARGS["sym g32"])
    monkeypatch.setattr(awq, "_CLIP_CHUNK_ELEMS", 10 * 64 * 7)  # 7 rows per chunk
    assert torch.equal(awq_clip_search(w, x, ARGS["sym g32"]), whole)


def _loop_awq_layer(layer, h, kw, group_size, n_grid):
    """The awq stage on one decoder layer (clip_in_search, unquantized inputs), written as loops:
    every candidate's clipped, quantized weights are loaded and the inspected submodule replayed."""
    args = QuantArgs(4, group_size=group_size)
    sdt, ratios = torch.bfloat16, []
    for prev_name, lin_names, inspect in (
        (
            "input_layernorm",
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
            "self_attn",
        ),
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
        ("mlp.up_proj", ("mlp.down_proj",), "mlp.down_proj"),
    ):
        prev, lins = layer.get_submodule(prev_name), [layer.get_submodule(r) for r in lin_names]
        mod, seen = layer.get_submodule(inspect), {}
        hooks = [
            mod.register_forward_pre_hook(
                lambda _m, a, k: seen.update(args=a, kwargs=k), with_kwargs=True
            ),
            lins[0].register_forward_pre_hook(lambda _m, a: seen.update(x=a[0])),
        ]
        layer(h, **kw)
        for hk in hooks:
            hk.remove()
        ref = mod(*seen["args"], **seen["kwargs"])
        ref = ref[0] if isinstance(ref, tuple) else ref
        x = seen["x"].reshape(-1, seen["x"].shape[-1])
        orig = [lin.weight.detach().clone() for lin in lins]
        clip = [not r.rsplit(".", 1)[-1].startswith(("q_", "k_")) for r in lin_names]

        def loss(s):
            for lin, w, c in zip(lins, orig, clip):
                ws = w * s
                if c:
                    lim = _loop_clip_search(ws, x / s, args, sdt).repeat_interleave(
                        group_size, dim=1
                    )
                    ws = torch.clamp(ws, -lim, lim)
                lin.weight.copy_(_loop_fake_quantize(ws, args, sdt) / s)
            out = mod(*seen["args"], **seen["kwargs"])
            for lin, w in zip(lins, orig):
                lin.weight.copy_(w)
            return ((out[0] if isinstance(out, tuple) else out) - ref).pow(2).mean().item()

        x_mean, w_mean = x.abs().mean(0), weight_group_absmean(torch.cat(orig), group_size)
        before = loss(torch.ones_like(x_mean))
        losses = [loss(candidate_scale(x_mean, w_mean, i / (n_grid - 1))) for i in range(n_grid)]
        best = min(range(n_grid), key=lambda i: (losses[i], i))
        ratios.append(
            (best / (n_grid - 1), losses[best] < before, before, min(losses[best], before))
        )
        if losses[best] < before:
            s = candidate_scale(x_mean, w_mean, best / (n_grid - 1))
            prev.weight.copy_(
                prev.weight / s[:, None] if isinstance(prev, nn.Linear) else prev.weight / s
            )
            for lin in lins:
                lin.weight.copy_(lin.weight * s)
    seen = {}
    targets = {
        n: m
        for n, m in layer.named_modules()
        if isinstance(m, nn.Linear) and not n.rsplit(".", 1)[-1].startswith(("q_", "k_"))
    }
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, n=n: seen.setdefault(n, a[0]))
        for n, m in targets.items()
    ]
    layer(h, **kw)
    for hk in hooks:
        hk.remove()
    for n, m in targets.items():
        xs = seen[n].reshape(-1, seen[n].shape[-1])
        lim = _loop_clip_search(m.weight, xs, args, sdt).repeat_interleave(group_size, dim=1)
        m.weight.copy_(torch.clamp(m.weight, -lim, lim))
    return ratios


@torch.no_grad()
def test_awq_stage_picks_the_scales_and_clips_of_plain_loops(tiny_checkpoint):
    """A decoder layer of the tiny GQA Llama (v_proj -> o_proj skipped) on 300 tokens: more than
    down_proj's 256 inputs, so its loss goes through the QR factor; every clip search sees all
    tokens (clip_tokens covers them)."""
    from transformers import AutoModelForCausalLM

    from slimserve.compress.calibration import capture_first_layer_inputs
    from slimserve.compress.mappings import mapping_for
    from slimserve.compress.quant.awq_stage import AwqOptions, AwqStage
    from slimserve.compress.stage import CompressionState, LayerContext

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (1, 300), generator=torch.Generator().manual_seed(0)
    )
    state = CompressionState(
        model=model, tokenizer=None, storage_dtype=torch.bfloat16, calibration=ids
    )
    mapping = mapping_for(model)
    inputs = capture_first_layer_inputs(model, mapping, [ids], torch.device("cpu"))
    layer = model.model.layers[0]
    twin = copy.deepcopy(layer)
    want = _loop_awq_layer(twin, inputs.hidden[0], inputs.kwargs[0], 32, n_grid=4)

    stage = AwqStage(AwqOptions(group_size=32, n_grid=4, clip_tokens=4096, quantized_inputs=False))
    stage.prepare(state)
    stage.compress_layer(
        LayerContext(0, "model.layers.0", layer, inputs, mapping, state, torch.device("cpu"))
    )
    got = stage.report.details["mappings"]
    assert [m["prev"] for m in got] == [
        "input_layernorm",
        "post_attention_layernorm",
        "mlp.up_proj",
    ]
    assert any(r[1] for r in want) and any(r[0] > 0 for r in want)  # the case does rescale
    for m, (ratio, applied, before, after) in zip(got, want):
        assert (m["ratio"], m["applied"]) == (round(ratio, 4), applied)
        assert m["loss_before"] == pytest.approx(before, rel=1e-4)
        assert m["loss_after"] == pytest.approx(after, rel=1e-4)
    for (name, a), b in zip(layer.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0, msg=name)
