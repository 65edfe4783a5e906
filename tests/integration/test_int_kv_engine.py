"""The engine with INT8 / INT4 KV caches (kernels/kv_quant.py): prefix hits, forced preemption,
tensor parallel (TP=2 over gloo), the prefill/decode hand-over of the blocks, the disaggregation
layout and /metrics usage, each against the same engine with the same cache dtype and nothing of
that feature, token for token.

Why equality holds: a row's codes depend only on that token's K/V, which fp32 computes the same
way whether the token was prefilled, recomputed after a preemption or found in the prefix cache
(summation orders aside, ~1e-6 relative: a code flips only when a value sits within that of a
rounding boundary, and greedy argmax moves only if two logits tie that closely; the trained demo
model's do not on these prompts). The caches are compared with the unquantized engine's tokens
too: int8 should agree on nearly all of them (a check that the quantized path is really serving).
"""

import pytest
import torch

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.disagg.errors import KVLayoutError
from slimserve.runtime.disagg.layout import layout_of
from slimserve.runtime.disagg.segment import new_name
from slimserve.runtime.disagg.transfer import load_import
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.worker.model_runner import kv_block_bytes, kv_capacity
from tests.helpers import DEMO_MODEL

PREFIX = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"
PROMPTS = [
    "def add(a, b):\n    return",
    PREFIX + "    parser.add_argument('--name')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def",
    PREFIX + "    args = parser.parse_args(argv)\n",
    "for i in range(10):\n",
    PREFIX,
]
MAX_TOKENS = [24, 9, 31, 17, 5, 20]
FP32 = {"device": "cpu", "dtype": "float32"}


def _run(llm: LLM, prompts=PROMPTS, max_tokens=MAX_TOKENS):
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module", params=["int8", "int4"])
def reference(request):
    """(kv dtype, tokens) of a roomy engine without prefix caching or chunking."""
    kv = request.param
    llm = LLM(str(DEMO_MODEL), kv_cache_dtype=kv, enable_prefix_caching=False, **FP32)
    return kv, _run(llm)


def test_int8_agrees_with_the_unquantized_cache():
    plain = _run(LLM(str(DEMO_MODEL), **FP32))
    int8 = _run(LLM(str(DEMO_MODEL), kv_cache_dtype="int8", **FP32))
    same = sum(a == b for x, y in zip(plain, int8) for a, b in zip(x, y))
    assert same >= 0.9 * sum(map(len, plain)), (plain, int8)


def test_prefix_hits_and_chunked_prefill_change_nothing(reference):
    kv, want = reference
    llm = LLM(
        str(DEMO_MODEL),
        kv_cache_dtype=kv,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        block_size=8,
        **FP32,
    )
    runner = llm.engine.runner
    assert runner.kv_bits == int(kv[3]) and runner.kv_caches[0][0].dtype.itemsize == 1
    assert _run(llm) == want
    before = llm.engine.block_manager.prefix_cache_hit_rate
    assert _run(llm, PROMPTS[1::2], MAX_TOKENS[1::2]) == want[1::2]
    assert llm.engine.block_manager.prefix_cache_hit_rate > before
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_forced_preemption_changes_nothing(reference):
    kv, want = reference
    bits = int(kv[3])
    per_block = kv_block_bytes(4, 8, 2, 64, torch.uint8, bits)
    assert per_block == 2 * 4 * 8 * 2 * ((64 if bits == 8 else 32) + 4)
    llm = LLM(
        str(DEMO_MODEL),
        kv_cache_dtype=kv,
        block_size=8,
        kv_cache_memory=12 * per_block,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        **FP32,
    )
    assert llm.engine.runner.num_blocks == 12
    assert _run(llm) == want
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_cache_usage == 0.0


def test_tensor_parallel_2_generates_the_tokens_of_one_process(reference):
    kv, want = reference
    tp = LLM(
        str(DEMO_MODEL),
        kv_cache_dtype=kv,
        enable_prefix_caching=False,
        tensor_parallel_size=2,
        kv_cache_memory=16 * 2**20,
        **FP32,
    )
    try:
        assert tp.engine.runner.kv_caches[0][0].shape[2] == 1  # its own KV head, int rows
        assert _run(tp) == want
    finally:
        tp.shutdown()


def test_pipeline_parallel_2_generates_the_tokens_of_one_process(reference):
    """Two stages of two layers each, every stage its own int rows."""
    kv, want = reference
    pp = LLM(
        str(DEMO_MODEL),
        kv_cache_dtype=kv,
        enable_prefix_caching=False,
        pipeline_parallel_size=2,
        kv_cache_memory=16 * 2**20,
        **FP32,
    )
    try:
        assert len(pp.engine.runner.kv_caches) == 2 and pp.engine.runner.kv_bits == int(kv[3])
        assert _run(pp) == want
    finally:
        pp.shutdown()


def test_layout_names_the_int_cache_and_refuses_another(reference):
    kv, _ = reference
    runner = LLM(str(DEMO_MODEL), kv_cache_dtype=kv, **FP32).engine.runner
    layout = layout_of(runner)
    assert layout.kv_dtype == kv and layout.scales is None
    assert layout.row_bytes(0) == runner.kv_caches[0][0].shape[-1]
    swapped = "int4" if kv == "int8" else "int8"
    other = layout_of(LLM(str(DEMO_MODEL), kv_cache_dtype=swapped, **FP32).engine.runner)
    with pytest.raises(KVLayoutError, match=rf"kv_dtype is '{other.kv_dtype}' .* but '{kv}' here"):
        layout.check_matches(other)


def test_skip_layers_keep_those_layers_unquantized():
    llm = LLM(str(DEMO_MODEL), kv_cache_dtype="int4", kv_cache_skip_layers="0,3", **FP32)
    runner = llm.engine.runner
    kinds = [(k.dtype, k.shape[-1]) for k, _ in runner.kv_caches]
    assert kinds == [(torch.float32, 64), (torch.uint8, 36), (torch.uint8, 36), (torch.float32, 64)]
    layout = layout_of(runner)
    assert (layout.skip_layers, layout.row_bytes(0), layout.row_bytes(1)) == ("0,3", 256, 36)
    assert len(_run(llm, PROMPTS[:2], [4, 4])) == 2


def _finish(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step())
    return outs


def test_prefill_decode_handover_moves_the_int_blocks(reference, tmp_path, monkeypatch):
    """Prefill on one engine, its blocks exported (codes, scales and zeros as they are) and
    imported by another: the decode side continues with the tokens of one engine."""
    kv, want = reference
    monkeypatch.setenv("SLIMSERVE_KV_DIR", str(tmp_path / "kv"))
    prefill, decode = (
        LLMEngine(EngineConfig(model=str(DEMO_MODEL), kv_cache_dtype=kv, **FP32)) for _ in range(2)
    )
    for i in (0, 2):
        params = SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0)
        first = prefill.make_sequence(f"p{i}", PROMPTS[i], params)
        first.params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        name = new_name()
        prefill.add_sequence(first, kv_export=name)
        assert _finish(prefill)[f"p{i}"].error is None
        seq = decode.make_sequence(f"d{i}", PROMPTS[i], params)
        decode.add_sequence(
            seq, kv_import=load_import(name, decode.kv_layout, seq.prompt_token_ids)
        )
        assert _finish(decode)[f"d{i}"].outputs[0].token_ids == want[i]
    assert decode.block_manager.usage == 0.0


def test_metrics_count_the_int_rows(reference):
    """/metrics' KV numbers: the rank's cache bytes are the uint8 rows it holds, and usage moves
    with the blocks a running sequence takes."""
    kv, _ = reference
    llm = LLM(str(DEMO_MODEL), kv_cache_dtype=kv, kv_cache_memory=2**20, **FP32)
    runner, engine = llm.engine.runner, llm.engine
    held = sum(k.numel() + v.numel() for k, v in runner.kv_caches)  # uint8: one byte each
    assert runner.kv_cache_bytes == held == runner.rank_stats()[0].kv_cache_bytes
    engine.add_request("m", PROMPTS[2], SamplingParams(max_tokens=4, temperature=0.0))
    engine.step()
    n = len(engine.requests["m"].seq.prompt_token_ids)
    held = engine.stats().kv_cache_usage * runner.num_blocks
    assert held == pytest.approx(round(held)) and -(-n // 16) <= round(held) <= -(-(n + 1) // 16)
    _finish(engine)
    assert engine.stats().kv_cache_usage == 0.0


def test_capacity_at_the_same_memory():
    """int8 holds close to 2x the blocks of bf16 and int4 close to 4x, less the 4 bytes of scale
    and zero per row; the start-up line names them all."""
    rows = {
        name: blocks for name, blocks, _ in kv_capacity(2**30, 30, 16, 3, 64, 2048, torch.bfloat16)
    }
    per_row = {"bfloat16": 128, "fp8_e4m3": 64, "int8": 68, "int4": 36}
    for name, size in per_row.items():
        assert rows[name] == 2**30 // (2 * 16 * 3 * 30 * size)
    assert (
        1.85 < rows["int8"] / rows["bfloat16"] < 1.9 and 3.5 < rows["int4"] / rows["bfloat16"] < 3.6
    )
    runner = LLM(str(DEMO_MODEL), kv_cache_dtype="int4", **FP32).engine.runner
    line = runner.capacity_line()
    assert line.startswith(f"KV cache: int4, {runner.num_blocks} blocks of 16 tokens")
    assert all(name in line for name in ("float32", "fp8_e4m3", "int8", "int4"))
