"""Layers an fp8 KV cache keeps unquantized (the manifest's kv_cache_skip_layers, or
--kv-cache-dtype-skip-layers): their cache dtype, scales, bytes and the disaggregation layout."""

import dataclasses

import pytest
import torch

from slimserve.runtime.config import EngineConfig, parse_layers
from slimserve.runtime.disagg.errors import KVLayoutError
from slimserve.runtime.disagg.layout import layout_of
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.worker.model_runner import kv_block_bytes

FP8 = torch.float8_e4m3fn
PROMPTS = [[5, 17, 42, 99, 3, 250], [7] * 40, [300, 2, 11]]
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _llm(ckpt, **kw) -> LLM:
    return LLM(str(ckpt), device="cpu", dtype="bfloat16", enable_prefix_caching=False, **kw)


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_skipping_every_layer_serves_the_unquantized_tokens(tiny_checkpoint):
    plain = _llm(tiny_checkpoint)
    plain_dtype = plain.engine.runner.kv_dtype
    skip_all = _llm(tiny_checkpoint, kv_cache_dtype="fp8_e4m3", kv_cache_skip_layers="0,1")
    runner = skip_all.engine.runner
    assert runner.kv_dtype == FP8 and [k.dtype for k, _ in runner.kv_caches] == [plain_dtype] * 2
    assert _tokens(skip_all) == _tokens(plain)


def test_one_skipped_layer_has_its_own_cache_dtype_bytes_and_layout(tiny_checkpoint):
    llm = _llm(tiny_checkpoint, kv_cache_dtype="fp8_e4m3", kv_cache_skip_layers=[1])
    runner = llm.engine.runner
    plain = _llm(tiny_checkpoint).engine.runner.kv_dtype
    assert runner.kv_dtypes == [FP8, plain]
    assert [(k.dtype, v.dtype) for k, v in runner.kv_caches] == [(FP8, FP8), (plain, plain)]
    spec = runner.spec
    per_block = 2 * runner.block_size * runner.kv_heads * spec.head_dim * (1 + plain.itemsize)
    assert (
        kv_block_bytes(2, runner.block_size, runner.kv_heads, spec.head_dim, runner.kv_dtypes)
        == per_block
    )
    assert runner.kv_cache_bytes == runner.num_blocks * per_block
    assert runner.model.model.layers[1].self_attn.k_scale.item() == 1.0
    layout = layout_of(runner)
    assert (layout.skip_layers, layout.layer_dtype(0), layout.layer_dtype(1)) == ("1", FP8, plain)
    with pytest.raises(
        KVLayoutError,
        match=r"skip_layers is '' on .* but '1' here; start both with "
        r"--kv-cache-dtype-skip-layers",
    ):
        layout.check_matches(dataclasses.replace(layout, skip_layers="", skip_dtype=""))
    assert len(_tokens(llm)) == 3


def test_skip_layers_without_an_fp8_cache_change_nothing(tiny_checkpoint):
    runner = _llm(tiny_checkpoint, kv_cache_skip_layers="1").engine.runner
    assert runner.kv_dtypes == [runner.kv_dtype] * 2 and runner.kv_dtype != FP8
    assert layout_of(runner).skip_layers == ""


def test_bad_skip_layers_are_one_line_errors(tiny_checkpoint):
    with pytest.raises(
        ValueError,
        match=r"kv_cache_skip_layers: \[2, 5\] are not layers of this 2-layer "
        r"model; use 0 to 1",
    ):
        _llm(tiny_checkpoint, kv_cache_dtype="fp8_e4m3", kv_cache_skip_layers="5,2")
    with pytest.raises(ValueError, match=r"cannot read 'a,b' as layer indices; use e.g. 1,16"):
        EngineConfig(model=str(tiny_checkpoint), kv_cache_skip_layers="a,b")
    with pytest.raises(ValueError, match=r"\[-1\] are not layer indices"):
        parse_layers([-1])
    assert (
        parse_layers("16, 1,1") == [1, 16]
        and parse_layers("none") == []
        and parse_layers(None) is None
    )


def test_a_mixed_cache_hands_over_between_replicas(tiny_checkpoint, tmp_path, monkeypatch):
    """Prefill on one engine, export the fp8 and the unquantized layers' blocks, decode on
    another: the tokens of one engine."""
    from slimserve.runtime.disagg.segment import new_name
    from slimserve.runtime.disagg.transfer import load_import
    from slimserve.runtime.engine.llm_engine import LLMEngine

    monkeypatch.setenv("SLIMSERVE_KV_DIR", str(tmp_path / "kv"))

    def engine():
        return LLMEngine(
            EngineConfig(
                model=str(tiny_checkpoint),
                device="cpu",
                dtype="bfloat16",
                kv_cache_dtype="fp8_e4m3",
                kv_cache_skip_layers="0",
                kv_cache_memory=4 * 2**20,
            )
        )

    def run(e):
        outs = {}
        while e.has_unfinished():
            for o in e.step():
                outs[o.request_id] = o
        return outs

    prefill, decode = engine(), engine()
    prompt = list(range(3, 60))
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prefill.add_request("ref", prompt, params)
    ref = run(prefill)["ref"].outputs[0].token_ids
    seq = prefill.make_sequence("p", prompt, params)
    seq.params = dataclasses.replace(params, max_tokens=1)
    name = new_name()
    prefill.add_sequence(seq, kv_export=name)
    run(prefill)
    seq2 = decode.make_sequence("d", prompt, params)
    decode.add_sequence(seq2, kv_import=load_import(name, decode.kv_layout, seq2.prompt_token_ids))
    assert run(decode)["d"].outputs[0].token_ids == ref
