"""Layer-by-layer compression (compress/layer_store.py): the same artifact as the whole-model path,
the skeleton loader, spills, sharded weights, and which path a recipe takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from slimserve.compress.errors import RecipeError
from slimserve.compress.export.shards import concatenate
from slimserve.compress.layer_store import LayerStore, is_meta
from slimserve.compress.mappings import mapping_for
from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import preset
from slimserve.runtime.artifact.weights import INDEX_NAME, weight_files
from slimserve.runtime.corpus import read_texts
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.loading.lazy_weights import CheckpointTensors
from slimserve.runtime.loading.loader import load_model, load_skeleton
from tests.helpers.tiny_model import save_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")

RECIPE = """
model: {model}
output: {out}
calibration: {{dataset: "text:{calib}", num_samples: 4, seq_len: 64}}
eval: {{dataset: "text:{calib}", seq_len: 64, max_windows: 3, max_ppl_increase: 100.0}}
stages:
{stages}
export: {{format: {fmt}}}
"""


@pytest.fixture(scope="module")
def calib(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text("\n\n".join(read_texts("train")[:8])[:40_000])
    return path


@pytest.fixture(scope="module")
def tied_checkpoint(tmp_path_factory) -> Path:
    """The tiny Llama with tied embeddings (lm_head is embed_tokens: one tensor on disk)."""
    out = save_tiny_llama(tmp_path_factory.mktemp("tiny-tied"))
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop("lm_head.weight")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        out.update(load_file(str(folder / f)))
    return out


def _run(model: Path, calib: Path, out: Path, stages: str, fmt: str, memory: str, logs: list[str]):
    text = RECIPE.format(model=model, out=out, calib=calib, stages=stages, fmt=fmt)
    return run_recipe(
        parse_recipe(text, out.parent / "r.yaml"), log=logs.append, progress=False, memory=memory
    )


CASES = {
    "gptq": ("  - gptq: {scheme: W4A16, group_size: 32}", "compressed-tensors"),
    "gptq-format-asym": ("  - gptq: {scheme: W4A16_ASYM, group_size: 32, actorder: group}", "gptq"),
    "awq+gptq": (
        "  - awq: {scheme: W4A16, group_size: 32, n_grid: 4}\n"
        "  - gptq: {scheme: W4A16, group_size: 32}",
        "awq",
    ),
    "smoothquant+gptq-w8a8+kv": (
        "  - smoothquant: {alpha: 0.8}\n  - gptq: {scheme: W8A8}\n  - kv_cache: {dtype: fp8_e4m3}",
        "compressed-tensors",
    ),
    "gptq+kv-skip-sensitive": (
        "  - gptq: {scheme: W4A16, group_size: 32}\n"
        "  - kv_cache: {dtype: fp8_e4m3, skip_sensitive: 1, sensitivity_samples: 2}",
        "compressed-tensors",
    ),
}


@pytest.mark.parametrize(
    "case,tied",
    [(c, False) for c in CASES] + [("gptq", True)],
    ids=[*CASES, "gptq-tied-embeddings"],
)
def test_layers_and_whole_paths_write_the_same_artifact(
    case, tied, tiny_checkpoint, tied_checkpoint, calib, tmp_path
):
    stages, fmt = CASES[case]
    model = tied_checkpoint if tied else tiny_checkpoint
    logs_l: list[str] = []
    lazy = _run(model, calib, tmp_path / "lazy", stages, fmt, "auto", logs_l)
    assert any("one at a time" in m for m in logs_l), logs_l
    whole = _run(model, calib, tmp_path / "whole", stages, fmt, "whole", [])
    a, b = _weights(lazy.artifact), _weights(whole.artifact)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    # small: one file, byte for byte what the whole path writes
    assert (lazy.artifact / "model.safetensors").read_bytes() == (
        whole.artifact / "model.safetensors"
    ).read_bytes()
    ca, cb = (json.loads((p / "config.json").read_text()) for p in (lazy.artifact, whole.artifact))
    assert ca == cb
    for key in ("baseline", "final"):
        assert lazy.summary[key]["ppl"] == whole.summary[key]["ppl"]
        assert lazy.summary[key]["size_bytes"] == whole.summary[key]["size_bytes"]
    assert [s["ppl"] for s in lazy.summary["stages"]] == [s["ppl"] for s in whole.summary["stages"]]
    ma, mb = (
        json.loads((p / "slimserve.json").read_text()) for p in (lazy.artifact, whole.artifact)
    )
    assert (
        set(ma) == set(mb)
        and ma["files"] == mb["files"]
        and ma["partial_groups"] == mb["partial_groups"]
    )
    assert ma["kv_cache_skip_layers"] == mb["kv_cache_skip_layers"]
    if "skip-sensitive" in case:  # the per-layer KL, carried through skeleton layers, is the same
        sa, sb = (r.summary["stages"][-1]["details"]["sensitivity"] for r in (lazy, whole))
        assert sa["chosen"] == sb["chosen"] == ma["kv_cache_skip_layers"]
        assert sa["kl_per_layer"] == pytest.approx(sb["kl_per_layer"], rel=1e-6)
    loaded = load_model(lazy.artifact)  # and our loader reads it
    assert loaded.quantized


def test_whole_model_stage_takes_the_whole_path_and_layers_refuses_it(
    tiny_checkpoint, calib, tmp_path
):
    stages = "  - rtn: {scheme: W4A16, group_size: 32}"
    logs: list[str] = []
    _run(tiny_checkpoint, calib, tmp_path / "a", stages, "compressed-tensors", "auto", logs)
    assert any(
        "whole model is held in float32 (stage rtn works on the whole model)" in m for m in logs
    ), logs
    with pytest.raises(
        RecipeError, match="cannot be compressed layer by layer: stage rtn works on the whole"
    ):
        _run(tiny_checkpoint, calib, tmp_path / "b", stages, "compressed-tensors", "layers", [])


def test_skeleton_holds_only_the_trunk(tiny_checkpoint, tied_checkpoint):
    sk = load_skeleton(tiny_checkpoint, "model.layers")
    m = sk.model
    assert sk.dtype == torch.bfloat16
    assert all(p.device.type == "meta" for p in m.model.layers.parameters())
    assert (
        m.model.embed_tokens.weight.device.type == "cpu"
        and m.lm_head.weight.dtype == torch.bfloat16
    )
    ref = load_file(str(tiny_checkpoint / "model.safetensors"))
    assert torch.equal(m.lm_head.weight, ref["lm_head.weight"])
    assert m.model.rotary_emb.inv_freq.device.type == "cpu"  # built at construction, not meta
    tied = load_skeleton(tied_checkpoint, "model.layers").model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_skeleton_refuses_a_checkpoint_without_the_models_tensor_names(tiny_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in tiny_checkpoint.iterdir():
        if f.name != "model.safetensors":
            (bad / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    tensors["renamed.norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(
        ArtifactError, match="no tensor model.norm.weight under the model's own names"
    ):
        load_skeleton(bad, "model.layers")


def test_store_loads_spills_exactly_and_keeps_quantized_data_on_disk(tiny_checkpoint):
    sk = load_skeleton(tiny_checkpoint, "model.layers")
    quantized: dict[str, QuantizedWeight] = {}
    store = LayerStore(sk.model, mapping_for(sk.model), sk.checkpoint, quantized)
    try:
        layer = store.load(0)
        assert layer.mlp.up_proj.weight.dtype == torch.float32
        ref = load_file(str(tiny_checkpoint / "model.safetensors"))
        assert torch.equal(
            layer.mlp.up_proj.weight, ref["model.layers.0.mlp.up_proj.weight"].float()
        )
        layer.input_layernorm.weight.data.mul_(
            1 / 3
        )  # not exact in bf16: must come back as float32
        kept = layer.input_layernorm.weight.detach().clone()
        n = layer.mlp.up_proj.weight.shape
        qw = QuantizedWeight(
            torch.ones(n, dtype=torch.int8),
            torch.full((n[0], 1), 0.5, dtype=torch.bfloat16),
            None,
            None,
            preset("W8A8").weights,
        )
        quantized["model.layers.0.mlp.up_proj"] = qw
        store.done(0)
        assert layer.mlp.up_proj.weight.device.type == "cpu"  # held until the next layer is done
        store.load(1)
        store.done(1)
        assert layer.mlp.up_proj.weight.device.type == "meta" and is_meta(
            quantized["model.layers.0.mlp.up_proj"]
        )
        store.finish()
        back = store.load(0)
        assert torch.equal(back.input_layernorm.weight, kept)  # float32 spill: exact
        got = store.quantized_weights(0)["model.layers.0.mlp.up_proj"]
        assert torch.equal(got.codes, qw.codes) and torch.equal(got.scale, qw.scale)
        store.drop(0)
        assert back.mlp.up_proj.weight.device.type == "meta"
    finally:
        store.close()


def test_concatenate_shards_and_index(tmp_path):
    parts = []
    ref = {}
    for j in range(3):
        t = {
            f"p{j}.a": torch.arange(10, dtype=torch.float32) + j,
            f"p{j}.b": torch.full((3, 2), j, dtype=torch.bfloat16),
        }
        ref.update(t)
        parts.append(tmp_path / f"part{j}.safetensors")
        save_file(t, str(parts[-1]))
    one = tmp_path / "one"
    one.mkdir()
    assert concatenate(parts, one) == ["model.safetensors"]
    many = tmp_path / "many"
    many.mkdir()
    names = concatenate(parts, many, max_shard_bytes=60)  # 52 bytes a part: one part per shard
    assert names == [f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)]
    index = json.loads((many / INDEX_NAME).read_text())
    assert index["weight_map"]["p2.b"] == names[2]
    for folder in (one, many):
        got = _weights(folder)
        assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    assert set(CheckpointTensors(many).keys()) == set(ref)


def test_a_layerwise_run_holds_at_most_two_decoder_layers(
    tiny_checkpoint, calib, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    deep = tmp_path / "deep"
    cfg = LlamaConfig.from_pretrained(tiny_checkpoint)
    cfg.num_hidden_layers = 5
    torch.manual_seed(1)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(deep)
    AutoTokenizer.from_pretrained(tiny_checkpoint).save_pretrained(deep)
    held: list[int] = []
    load = LayerStore.load

    def counting_load(self, i, dtype=torch.float32):
        layer = load(self, i, dtype)
        real = [
            j
            for j, lay in enumerate(self.layers)
            if lay.self_attn.q_proj.weight.device.type != "meta"
        ]
        held.append(len(real))
        return layer

    monkeypatch.setattr(LayerStore, "load", counting_load)
    stages = "  - awq: {scheme: W4A16, group_size: 32, n_grid: 2}\n  - gptq: {scheme: W4A16, group_size: 32}"
    _run(deep, calib, tmp_path / "out", stages, "compressed-tensors", "layers", [])
    # 4 evaluations (baseline, after each stage) and the export read each layer alone; the stages
    # hold the previous layer until the next one is done
    assert len(held) == 5 * (3 + 2 + 1) and max(held) == 2


def test_cycling_layers_through_the_store_does_not_grow_the_resident_set(tiny_checkpoint, tmp_path):
    """Layer tensors below glibc's mmap threshold come from the heap; without `release_memory`
    after each layer the holes they leave grew the resident set by ~2 MB per demo-width layer."""
    from transformers import AutoTokenizer

    from slimserve.eval.bench_memory import model_config, write_checkpoint

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    write_checkpoint(
        tmp_path / "ck", model_config(16, len(tok), tok.eos_token_id), tok
    )  # demo width
    sk = load_skeleton(tmp_path / "ck", "model.layers")
    store = LayerStore(sk.model, mapping_for(sk.model), sk.checkpoint, {}, spill_dir=tmp_path)

    def rss_mb() -> float:
        return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0]) / 1024

    seen = []
    try:
        for i in range(16):
            store.load(i).mlp.up_proj.weight.data.mul_(0.5)  # changed: every layer is spilled
            store.done(i)
            seen.append(rss_mb())
        store.finish()
    finally:
        store.close()
    assert seen[-1] - seen[3] < 8, seen  # 12 more layers of 1.6M parameters each
