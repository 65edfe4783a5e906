"""FP8 KV cache: the round trip, scales, the fp8 attention function and what the stage measures."""

import pytest
import torch
from pydantic import ValidationError

from slimserve.compress.calibration import run_layerwise
from slimserve.compress.errors import RecipeError
from slimserve.compress.quant.kv_cache import KvCacheOptions, KvCacheStage, candidate_scales
from slimserve.compress.recipe import parse_recipe
from slimserve.compress.stage import CompressionState
from slimserve.runtime.artifact.compressed_tensors import (
    kv_cache_scheme,
    kv_tensors,
    quantization_config,
)
from slimserve.runtime.artifact.kv_scales import (
    FP8_E4M3_MAX,
    fp8_e4m3_roundtrip,
    kv_scale_from_absmax,
)
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.loading.hf_fp8kv import (
    fp8kv_attention_forward,
    observing_attention,
    register_fp8kv_attention,
    use_fp8kv_attention,
)
from slimserve.runtime.loading.loader import pop_kv_scales


def _fp8_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, ascending, as float32 (0x7F/0xFF are NaN)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return codes[~codes.isnan()].unique()  # unique merges +0 and -0


def test_roundtrip_is_torch_cast_bit_exact():
    torch.manual_seed(0)
    x = torch.cat([torch.randn(4096) * 100, torch.randn(4096) * 1e-3, _fp8_grid()])
    inside = x.abs() <= FP8_E4M3_MAX
    assert torch.equal(
        fp8_e4m3_roundtrip(x[inside], 1.0), x[inside].to(torch.float8_e4m3fn).float()
    )
    grid = _fp8_grid()
    assert torch.equal(fp8_e4m3_roundtrip(grid, 1.0), grid)  # representable values are fixed points
    # With a power-of-two scale the division is exact, so the grid scales with it.
    assert torch.equal(fp8_e4m3_roundtrip(grid * 0.125, 0.125), grid * 0.125)


def test_roundtrip_ties_go_to_even_and_saturate_at_448():
    grid = _fp8_grid()
    pos = grid[grid > 0]
    mid = (pos[:-1] + pos[1:]) / 2  # exact in float32: halfway between fp8 neighbours
    out = fp8_e4m3_roundtrip(mid, 1.0)
    assert torch.equal(out, mid.to(torch.float8_e4m3fn).float())
    codes = out.to(torch.float8_e4m3fn).view(torch.uint8)
    assert bool((codes % 2 == 0).all())  # round half to even mantissa
    assert fp8_e4m3_roundtrip(torch.tensor([1.0625, 1.1875]), 1.0).tolist() == [1.0, 1.25]
    big = torch.tensor([448.0, 449.0, 464.0, 480.0, 1e30, float("inf"), -500.0, float("-inf")])
    assert fp8_e4m3_roundtrip(big, 1.0).tolist() == [448.0] * 6 + [-448.0] * 2
    assert fp8_e4m3_roundtrip(torch.tensor([900.0]), 2.0).item() == 896.0  # 448 * scale


def test_roundtrip_keeps_dtype_and_uses_scale():
    x = torch.tensor([3.0, -7.5, 0.01], dtype=torch.bfloat16)
    out = fp8_e4m3_roundtrip(x, torch.tensor([0.5]))
    assert out.dtype == torch.bfloat16
    ref = ((x.float() / 0.5).to(torch.float8_e4m3fn).float() * 0.5).to(torch.bfloat16)
    assert torch.equal(out, ref)


def test_scale_from_absmax():
    assert kv_scale_from_absmax(448.0) == 1.0
    assert kv_scale_from_absmax(10.0) == pytest.approx(10.0 / 448)
    tiny = kv_scale_from_absmax(0.0)  # an all-zero tensor: still a usable scale in any dtype
    assert tiny > 0 and torch.tensor(tiny, dtype=torch.float16).item() > 0


def test_options_refuse_other_dtypes_listing_supported():
    assert KvCacheOptions().dtype == "fp8_e4m3"
    assert KvCacheOptions(dtype="int8").dtype == "int8"  # per token, no calibration
    with pytest.raises(
        ValidationError, match="'int2' is not supported; supported: fp8_e4m3, int8, int4"
    ):
        KvCacheOptions(dtype="int2")
    with pytest.raises(
        RecipeError, match=r"stages\[0\].kv_cache.dtype: dtype 'fp8_e5m2'.*fp8_e4m3"
    ):
        parse_recipe("model: x\noutput: y\nstages:\n  - kv_cache: {dtype: fp8_e5m2}\n")


def test_options_headroom_and_search_bounds():
    opts = KvCacheOptions()
    assert (opts.headroom, opts.scale_search) == (2.0, 8)
    with pytest.raises(ValidationError, match="headroom 0.5 is out of range; use 1 to 64"):
        KvCacheOptions(headroom=0.5)
    with pytest.raises(
        ValidationError, match="scale_search 0 is out of range; use 1 .no search. to 32"
    ):
        KvCacheOptions(scale_search=0)
    with pytest.raises(RecipeError, match=r"stages\[0\].kv_cache.headroom"):
        parse_recipe("model: x\noutput: y\nstages:\n  - kv_cache: {headroom: 100}\n")


def test_candidate_scales_span_one_binade_above_the_headroom():
    grid = candidate_scales(10.0, 2.0, 8, torch.float32)
    assert len(grid) == 8 and grid == sorted(grid)
    assert grid[0] == pytest.approx(2 * 10.0 / 448) and grid[-1] == pytest.approx(
        2 * 10.0 / 448 * 2 ** (7 / 8)
    )
    assert grid[-1] < 2 * grid[0]  # 2 x the first scale gives the first one's grid again
    # Rounded to the storage dtype: the scale tried is the scale stored.
    assert all(
        s == torch.tensor(s, dtype=torch.bfloat16).item()
        for s in candidate_scales(10.0, 2.0, 8, torch.bfloat16)
    )
    # headroom 1, no search: the plain absmax / 448 scale
    assert candidate_scales(10.0, 1.0, 1, torch.float16) == [
        torch.tensor(10.0 / 448, dtype=torch.float16).item()
    ]


def _attn_inputs(seed=0, b=2, heads=4, kv_heads=2, s=37, d=32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=g)
    k = torch.randn(b, kv_heads, s, d, generator=g) * 3
    v = torch.randn(b, kv_heads, s, d, generator=g)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    return module, q, k, v


def test_fp8_attention_close_to_unquantized_with_calibrated_scales():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module, q, k, v = _attn_inputs()
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=32**-0.5)
    same, _ = fp8kv_attention_forward(module, q, k, v, None, scaling=32**-0.5)
    assert torch.equal(same, ref)  # no k_scale/v_scale buffers yet: plain sdpa
    module.register_buffer("k_scale", torch.tensor([kv_scale_from_absmax(k.abs().max().item())]))
    module.register_buffer("v_scale", torch.tensor([kv_scale_from_absmax(v.abs().max().item())]))
    out, _ = fp8kv_attention_forward(module, q, k, v, None, scaling=32**-0.5)
    rel = (torch.linalg.norm(out - ref) / torch.linalg.norm(ref)).item()
    # e4m3 keeps 3 mantissa bits: each K/V element is off by at most 2^-4 relative (half an ulp),
    # about 2^-4/sqrt(3) ~ 3.6% rms. The output mixes V rows (errors average out) and the
    # logits' error is damped by the softmax, so the output's relative error stays below 2^-4.
    assert 0 < rel < 2**-4
    # K and V already on the fp8 grid of their scales: the round trip is exact, so is the output.
    kq, vq = fp8_e4m3_roundtrip(k, module.k_scale), fp8_e4m3_roundtrip(v, module.v_scale)
    exact, _ = fp8kv_attention_forward(module, q, kq, vq, None, scaling=32**-0.5)
    torch.testing.assert_close(
        exact, sdpa_attention_forward(module, q, kq, vq, None, scaling=32**-0.5)[0], rtol=0, atol=0
    )


_SEEN: dict[
    int, tuple[float, float]
] = {}  # layer index -> (K absmax, V absmax) as attention saw them


def _capture_attention(module, query, key, value, attention_mask, **kwargs):
    """Records the absmax of the K/V the attention receives (after k_norm and RoPE), then sdpa."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k0, v0 = _SEEN.get(module.layer_idx, (0.0, 0.0))
    _SEEN[module.layer_idx] = (max(k0, key.abs().max().item()), max(v0, value.abs().max().item()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _tiny(arch: str):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[arch]
    torch.manual_seed(0)
    cfg = cls(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
    )
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    if arch == "qwen3":  # non-trivial k_norm weights, so skipping k_norm would show
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.data.uniform_(0.5, 3.0)
    return model


def _run_recording(model, ids, name: str, attention, store: list) -> None:
    """Run `ids` through `model` in two batches with `attention` (which appends to `store`) as
    its attention implementation, registered under `name`."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, attention)
    model.set_attn_implementation(name)
    store.clear()
    with torch.no_grad():
        model(input_ids=ids[:2], use_cache=False)
        model(input_ids=ids[2:], use_cache=False)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_stage_measures_k_after_norm_and_rope(arch):

    model = _tiny(arch)
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(1))
    _run_recording(model, ids, "test_capture_kv", _capture_attention, _SEEN)
    k_ref, v_ref = _SEEN[0]  # layer 0 sees the same inputs with and without fp8 KV upstream

    state = CompressionState(
        model=model, tokenizer=None, storage_dtype=torch.bfloat16, calibration=ids
    )
    stage = KvCacheStage(KvCacheOptions(headroom=1.0, scale_search=1))
    stage.prepare(state)
    run_layerwise(state, stage, batch_size=2)
    report = stage.finalize(state)
    layer0 = report.details["layers"]["model.layers.0.self_attn"]
    assert layer0["k_absmax"] == pytest.approx(k_ref, rel=1e-6)
    assert layer0["v_absmax"] == pytest.approx(v_ref, rel=1e-6)
    assert sorted(state.kv_scales) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    k_scale, v_scale = state.kv_scales["model.layers.0.self_attn"]
    assert (
        k_scale == torch.tensor(k_ref / 448, dtype=torch.bfloat16).item()
    )  # rounded to storage dtype
    assert (layer0["k_scale"], layer0["v_scale"]) == (k_scale, v_scale)
    attn = model.model.layers[0].self_attn
    assert attn.k_scale.shape == (1,) and attn.k_scale.item() == k_scale
    assert model.config._attn_implementation == register_fp8kv_attention()


def test_kv_only_config_block_and_tensors():
    from compressed_tensors.quantization import QuantizationConfig

    qc = quantization_config(
        {}, {"model.layers.0.mlp.up_proj": "Linear", "lm_head": "Linear"}, kv_cache_scheme()
    )
    assert qc["config_groups"] == {} and qc["format"] == "dense" and qc["ignore"] == []
    parsed = QuantizationConfig.model_validate(qc)
    assert parsed.kv_cache_scheme.type == "float" and parsed.kv_cache_scheme.num_bits == 8
    t = kv_tensors({"model.layers.0.self_attn": (0.5, 0.25)}, torch.bfloat16)
    assert set(t) == {"model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.v_scale"}
    assert t["model.layers.0.self_attn.v_scale"].dtype == torch.bfloat16
    assert t["model.layers.0.self_attn.v_scale"].tolist() == [0.25]


def test_loader_kv_scale_errors(tmp_path):
    model = _tiny("llama")
    qc = {"kv_cache_scheme": kv_cache_scheme()}
    tensors = kv_tensors(
        {f"model.layers.{i}.self_attn": (0.5, 0.25) for i in range(2)}, torch.bfloat16
    )
    tensors["other"] = torch.zeros(1)
    scales = pop_kv_scales(model, qc, tensors, tmp_path)
    assert scales["model.layers.1.self_attn"] == (0.5, 0.25) and list(tensors) == ["other"]
    assert pop_kv_scales(model, {"kv_cache_scheme": None}, tensors, tmp_path) == {}
    partial = kv_tensors({"model.layers.0.self_attn": (0.5, 0.25)}, torch.bfloat16)
    with pytest.raises(ArtifactError, match=r"model.layers.1.self_attn.k_scale is missing"):
        pop_kv_scales(model, qc, partial, tmp_path)
    with pytest.raises(
        ArtifactError, match="kv_cache_scheme .* not supported; supported: static fp8"
    ):
        pop_kv_scales(model, {"kv_cache_scheme": kv_cache_scheme() | {"type": "int"}}, {}, tmp_path)


_QKV: list[tuple[torch.Tensor, ...]] = []  # layer 0's (query, key, value) per call


def _record_layer0(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if module.layer_idx == 0:
        _QKV.append((query.clone(), key.clone(), value.clone()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def test_stage_search_keeps_the_scale_with_least_attention_error():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = _tiny("llama")
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(2))
    _run_recording(model, ids, "test_record_qkv", _record_layer0, _QKV)
    attn = model.model.layers[0].self_attn

    def error(k_scale=None, v_scale=None) -> float:  # independent of the stage's code path
        total = 0.0
        for q, k, v in _QKV:
            ref = sdpa_attention_forward(attn, q, k, v, None, scaling=attn.scaling, is_causal=True)[
                0
            ]
            kq = fp8_e4m3_roundtrip(k, k_scale) if k_scale else k
            vq = fp8_e4m3_roundtrip(v, v_scale) if v_scale else v
            out = sdpa_attention_forward(
                attn, q, kq, vq, None, scaling=attn.scaling, is_causal=True
            )[0]
            total += (out - ref).square().sum().item()
        return total

    k_absmax = max(k.abs().max().item() for _, k, _ in _QKV)
    v_absmax = max(v.abs().max().item() for _, _, v in _QKV)
    k_grid = candidate_scales(k_absmax, 2.0, 8, torch.float32)
    v_grid = candidate_scales(v_absmax, 2.0, 8, torch.float32)
    k_errs, v_errs = [error(k_scale=s) for s in k_grid], [error(v_scale=s) for s in v_grid]

    state = CompressionState(
        model=model, tokenizer=None, storage_dtype=torch.float32, calibration=ids
    )
    stage = KvCacheStage(KvCacheOptions())
    stage.prepare(state)
    run_layerwise(state, stage, batch_size=2)
    layer0 = stage.finalize(state).details["layers"]["model.layers.0.self_attn"]
    k_scale, v_scale = state.kv_scales["model.layers.0.self_attn"]
    assert k_scale == pytest.approx(k_grid[k_errs.index(min(k_errs))], rel=1e-6)
    assert v_scale == pytest.approx(v_grid[v_errs.index(min(v_errs))], rel=1e-6)
    assert layer0["k_error_vs_first"] == pytest.approx(min(k_errs) / k_errs[0], rel=1e-3)
    assert layer0["k_absmax"] == pytest.approx(k_absmax, rel=1e-6)
    assert max(k_errs) > min(k_errs)  # the grid's position matters, so the search can fail


def test_observing_attention_sees_the_call_before_fp8_and_detaches():
    module, q, k, v = _attn_inputs()
    module.register_buffer("k_scale", torch.tensor([0.5]))
    module.register_buffer("v_scale", torch.tensor([0.5]))
    seen = []
    with observing_attention(module, lambda *a: seen.append(a)):
        with pytest.raises(RuntimeError, match="already observed"):
            with observing_attention(module, lambda *a: None):
                pass
        fp8kv_attention_forward(module, q, k, v, None, scaling=0.1)
    fp8kv_attention_forward(module, q, k, v, None, scaling=0.1)
    assert len(seen) == 1
    query, key, value, mask, kwargs = seen[0]
    assert key is k and value is v and query is q and mask is None and kwargs == {"scaling": 0.1}
    model = _tiny("llama")
    use_fp8kv_attention(model)  # the model-level switch is untouched by observing
    assert model.config._attn_implementation == register_fp8kv_attention()
