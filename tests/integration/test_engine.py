"""The paged engine against a plain dense greedy loop over the same weights, token for token.

The dense loop is transformers' own model (loaded by our loader, fp32) recomputing the whole
sequence every step: no KV cache, no paging, no batching. The engine runs fp32 too, so the only
differences are summation orders (~1e-6 relative on logits): greedy argmax agrees unless two
logits tie that closely, which the trained demo model does not do on these prompts.
"""

import pytest
import torch

from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from slimserve.runtime.loading.loader import load_model
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


def dense_greedy(model, ids: list[int], n: int, eos: set[int]) -> list[int]:
    out = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids + out])).logits[0, -1]
            out.append(int(logits.argmax()))
            if out[-1] in eos:
                break
    return out


@pytest.fixture(scope="module")
def dense_outputs():
    loaded = load_model(DEMO_MODEL, dtype=torch.float32)
    tok = loaded.tokenizer
    eos = {tok.eos_token_id}
    return [
        dense_greedy(loaded.model, tok(p).input_ids, n, eos) for p, n in zip(PROMPTS, MAX_TOKENS)
    ]


def _run(llm: LLM, prompts, max_tokens):
    params = [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def test_engine_equals_dense_with_chunked_prefill_and_prefix_hits(dense_outputs):
    # 16-token budget: every prompt is prefilled in chunks while others decode in the same step
    llm = LLM(str(DEMO_MODEL), max_num_batched_tokens=16, max_num_seqs=4, block_size=8)
    assert _run(llm, PROMPTS, MAX_TOKENS) == dense_outputs
    # second wave: the prompts' full blocks are cached now
    before = llm.engine.block_manager.prefix_cache_hit_rate
    assert _run(llm, PROMPTS[1::2], MAX_TOKENS[1::2]) == dense_outputs[1::2]
    assert llm.engine.block_manager.prefix_cache_hit_rate > before
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_engine_equals_dense_under_forced_preemption(dense_outputs):
    # 12 blocks of 8 tokens = 96 slots for 6 sequences of up to ~80 tokens: they cannot all run,
    # so the scheduler preempts (drops KV, recomputes later) and the output must not change.
    per_block = 2 * 4 * 8 * 2 * 64 * 4  # K and V, 4 layers, 8 tokens, 2 KV heads, head_dim 64, fp32
    llm = LLM(
        str(DEMO_MODEL),
        block_size=8,
        kv_cache_memory=12 * per_block,
        max_num_seqs=6,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        dtype="float32",
    )
    assert llm.engine.runner.num_blocks == 12
    assert _run(llm, PROMPTS, MAX_TOKENS) == dense_outputs
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage == 0.0


def test_seeded_sampling_is_reproducible_regardless_of_batch():
    llm = LLM(str(DEMO_MODEL), max_num_seqs=8)
    p = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, logprobs=3)
    alone = llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0]
    mixed = llm.generate(
        [PROMPTS[2], PROMPTS[0], PROMPTS[4]],
        [SamplingParams(max_tokens=7), p, SamplingParams(max_tokens=3, temperature=1.0)],
        use_tqdm=False,
    )[1].outputs[0]
    assert alone.token_ids == mixed.token_ids
    assert len(alone.logprobs) == 12
    chosen, top = alone.logprobs[0]
    assert len(top) == 3 and chosen <= 0 and max(top.values()) >= chosen


def test_stop_strings_and_stop_tokens():
    llm = LLM(str(DEMO_MODEL))
    free = llm.generate(PROMPTS[2], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
    text = free.outputs[0].text
    stop = text[5:8]
    cut = llm.generate(
        PROMPTS[2], SamplingParams(max_tokens=30, temperature=0, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == text[: text.find(stop)]
    tok3 = free.outputs[0].token_ids[3]
    by_id = llm.generate(
        PROMPTS[2],
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[tok3]),
        use_tqdm=False,
    )[0].outputs[0]
    assert by_id.token_ids == free.outputs[0].token_ids[: free.outputs[0].token_ids.index(tok3) + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == tok3
