"""`gptq` through the pipeline on a tiny Llama: report losses, loadable artifact, g_idx on disk."""

import json

import pytest
import torch
from safetensors import safe_open

from slimserve.compress.errors import RecipeError
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.corpus import read_texts
from slimserve.runtime.loading.loader import load_model

pytestmark = pytest.mark.usefixtures("one_thread")


RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: "text:calib.txt", num_samples: 8, seq_len: 64}}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 4, max_ppl_increase: 10.0}}
stages:
  - gptq: {{scheme: W4A16, group_size: 32{extra}}}
"""


@pytest.fixture(scope="module", params=["static", "group"])
def gptq_run(request, tiny_checkpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"gptq-{request.param}")
    # A 100 kB slice of the stdlib train split: `dataset: stdlib` tokenizes all 10.8 MB of it
    # (~20 s here), which would dominate the test; the windows come from the same text.
    (tmp / "calib.txt").write_text("\n\n".join(read_texts("train")[:16])[:100_000])
    text = RECIPE.format(
        model=tiny_checkpoint, out=tmp / "art", extra=f", actorder: {request.param}"
    )
    res = run_recipe(parse_recipe(text, tmp / "r.yaml"), log=lambda m: None, progress=False)
    return request.param, res


def test_gptq_report_and_losses(gptq_run):
    actorder, res = gptq_run
    stage = res.summary["stages"][0]
    assert stage["name"] == "gptq"
    assert len(stage["modules"]) == 2 * 7  # q,k,v,o,gate,up,down per layer; lm_head ignored
    d = stage["details"]
    assert d["scheme"]["actorder"] == actorder and d["fallbacks"] == {}
    losses = d["losses"]
    assert set(losses) == {m["name"] for m in stage["modules"]}
    better = sum(v["gptq_loss"] <= v["rtn_loss"] for v in losses.values())
    assert better >= 0.8 * len(losses), losses  # measured: all 14 of 14
    assert d["loss_ratio"]["not_worse"] == better and d["loss_ratio"]["geomean"] < 1.0


def test_gptq_artifact_loads(gptq_run):
    actorder, res = gptq_run
    art = res.artifact
    loaded = load_model(art, dtype=torch.float32)
    assert loaded.quantized
    q = json.loads((art / "config.json").read_text())["quantization_config"]
    weights = q["config_groups"]["group_0"]["weights"]
    assert weights["actorder"] == {"static": "weight", "group": "group"}[actorder]
    with safe_open(art / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        g_idx_key = "model.layers.0.mlp.down_proj.weight_g_idx"
        if actorder == "group":  # groups formed in act-order: each column names its group
            g_idx = f.get_tensor(g_idx_key)
            assert g_idx.shape == (256,) and torch.equal(
                torch.bincount(g_idx.long()), torch.full((8,), 32)
            )
        else:  # static groups are the contiguous blocks: nothing extra on disk
            assert not any(k.endswith("weight_g_idx") for k in keys)
    # The loaded model computes what the pipeline measured (fake-quant weights == dequantized).
    ids = torch.arange(1, 33).unsqueeze(0)
    with torch.no_grad():
        assert torch.isfinite(loaded.model(ids).logits).all()


def test_actorder_with_channel_scheme_is_a_clear_error():
    text = "model: x\noutput: y\nstages:\n  - gptq: {scheme: W8A16, actorder: group}\n"
    with pytest.raises(RecipeError, match="actorder='group' needs strategy 'group'.*group_size"):
        parse_recipe(text)


def _stage_on_tiny(tiny_checkpoint, monkeypatch, calibration_dtype="auto", **options):
    """Run GptqStage alone (no pipeline) on the tiny model; returns (state, stage, hessian log)."""
    from transformers import AutoModelForCausalLM

    from slimserve.compress.calibration import run_layerwise
    from slimserve.compress.quant import gptq_stage
    from slimserve.compress.stage import CompressionState

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4, 32))
    state = CompressionState(
        model=model,
        tokenizer=None,
        storage_dtype=torch.bfloat16,
        calibration=ids,
        calibration_dtype=calibration_dtype,
    )
    log = []  # (group collected, modules already quantized at that moment)
    real = gptq_stage._collect_hessians

    def spy(ctx, rels, keep=None):
        log.append(([f"{ctx.prefix}.{r}" for r in rels], set(state.quantized)))
        return real(ctx, rels, keep)

    monkeypatch.setattr(gptq_stage, "_collect_hessians", spy)
    stage = gptq_stage.GptqStage(gptq_stage.GptqOptions(**options))
    stage.prepare(state)
    run_layerwise(state, stage)
    return state, stage, log


def test_true_sequential_and_outside_linears(tiny_checkpoint, monkeypatch):
    state, stage, log = _stage_on_tiny(tiny_checkpoint, monkeypatch, group_size=32, ignore=[])
    groups = [g for g, _ in log]
    assert groups[:4] == [
        [f"model.layers.0.self_attn.{p}_proj" for p in "qkv"],
        ["model.layers.0.self_attn.o_proj"],
        ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"],
        ["model.layers.0.mlp.down_proj"],
    ]
    for group, done in log:  # each group's H is collected after every earlier group was quantized
        earlier = [n for g, _ in log[: log.index((group, done))] for n in g]
        assert set(earlier) <= done and not set(group) & done
    report = stage.finalize(state)
    assert "lm_head" in state.quantized and "lm_head" not in report.details["losses"]
    assert any("lm_head" in n and "RTN" in n for n in report.details["notes"])
    w = state.model.lm_head.weight
    assert torch.equal(w, state.quantized["lm_head"].dequantize(torch.bfloat16).float())
    assert len(report.modules) == 2 * 7 + 1


def test_w8a8_attaches_input_quant(tiny_checkpoint, monkeypatch):
    state, stage, _ = _stage_on_tiny(tiny_checkpoint, monkeypatch, scheme="W8A8")
    report = stage.finalize(state)
    qw = state.quantized["model.layers.1.mlp.down_proj"]
    assert qw.args.strategy == "channel" and qw.args.actorder is None and qw.scale.shape == (128, 1)
    assert state.model.model.layers[1].mlp.down_proj._slimserve_input_quant is not None
    assert report.details["loss_ratio"]["not_worse"] == 14


def test_shared_input_hessians_and_bf16_replay(tiny_checkpoint, monkeypatch):
    """q/k/v (and gate/up) share one accumulation, one H handed to GPTQ for all three; the bf16 replay
    (calibration.dtype auto on a bf16 checkpoint) gives the fp32 replay's Hessians to bf16
    accuracy and leaves the model in float32."""
    from slimserve.compress.quant import gptq_stage

    seen = {}
    real = gptq_stage._collect_hessians

    def keep(ctx, rels, kept=None):
        out = real(ctx, rels, kept)
        if ctx.index == 0 and "self_attn.q_proj" in rels:
            h = {r: hess for readers, hess, _ in out for r in readers}
            counts = {r: n for readers, _, n in out for r in readers}
            seen.setdefault("runs", []).append((h, counts, next(ctx.layer.parameters()).dtype))
        return out

    monkeypatch.setattr(gptq_stage, "_collect_hessians", keep)
    dtypes = []
    for calibration_dtype in ("auto", "float32"):
        state, _, _ = _stage_on_tiny(tiny_checkpoint, monkeypatch, calibration_dtype, group_size=32)
        dtypes.append({p.dtype for p in state.model.parameters()})
    (h16, c16, dt16), (h32, c32, dt32) = seen["runs"]
    assert (dt16, dt32) == (torch.bfloat16, torch.float32) and dtypes == [{torch.float32}] * 2
    q, k, v = (f"self_attn.{p}_proj" for p in "qkv")
    assert h16[q] is h16[k] and h16[q] is h16[v] and len({id(h) for h in h16.values()}) == 1
    assert c16[q] == c16[k] == c16[v] == 4 * 32 and c32 == c16
    torch.testing.assert_close(h16[q], h32[q], rtol=0.02, atol=0.02 * h32[q].abs().max().item())


@pytest.mark.parametrize(
    "calibration_dtype, scheme", [("float32", "W4A16"), ("auto", "W4A16"), ("float32", "W8A8")]
)
def test_layer_outputs_from_kept_down_proj_inputs(
    tiny_checkpoint, monkeypatch, calibration_dtype, scheme
):
    """After down_proj, the layer's outputs come from down_proj's kept inputs plus the residual
    (no replay of the layer): bit-identical to replaying the quantized layer, in the replay's
    dtype, so the whole run is the one without the shortcut (ArchMapping.mlp_residual None)."""
    from dataclasses import replace

    from slimserve.compress import mappings
    from slimserve.compress.quant import gptq_stage
    from slimserve.compress.stage import LayerContext

    compared = []
    real = gptq_stage.GptqStage.compress_layer

    def check(self, ctx: LayerContext):
        real(self, ctx)
        assert ctx.outputs is not None and not ctx.extra
        full = ctx.forward()
        assert len(full) == len(ctx.outputs) == 1  # 4 calibration sequences: one batch of 8
        for a, b in zip(ctx.outputs, full):
            assert a.dtype == b.dtype and a.device.type == "cpu" and torch.equal(a, b)
        compared.append(ctx.index)

    monkeypatch.setattr(gptq_stage.GptqStage, "compress_layer", check)
    # W8A8: input quant hooks too
    options = {"group_size": 32} if scheme == "W4A16" else {"scheme": scheme}
    with_shortcut, _, _ = _stage_on_tiny(tiny_checkpoint, monkeypatch, calibration_dtype, **options)
    assert compared == [0, 1]
    monkeypatch.setattr(gptq_stage.GptqStage, "compress_layer", real)
    monkeypatch.setitem(
        mappings.ARCHITECTURES, "llama", replace(mappings.ARCHITECTURES["llama"], mlp_residual=None)
    )
    without, _, _ = _stage_on_tiny(tiny_checkpoint, monkeypatch, calibration_dtype, **options)
    assert with_shortcut.quantized.keys() == without.quantized.keys()
    for name, qw in with_shortcut.quantized.items():
        assert torch.equal(qw.codes, without.quantized[name].codes) and torch.equal(
            qw.scale, without.quantized[name].scale
        )


def test_no_shortcut_when_kept_inputs_would_not_fit(tiny_checkpoint, monkeypatch):
    from slimserve.compress.quant import gptq_stage

    monkeypatch.setattr(gptq_stage, "available_memory", lambda: 1000)  # bytes: nothing fits
    seen = []
    real = gptq_stage.GptqStage.compress_layer

    def spy(self, ctx):
        real(self, ctx)
        seen.append(ctx.outputs)

    monkeypatch.setattr(gptq_stage.GptqStage, "compress_layer", spy)
    _stage_on_tiny(tiny_checkpoint, monkeypatch, "float32", group_size=32)
    assert seen == [None, None]
