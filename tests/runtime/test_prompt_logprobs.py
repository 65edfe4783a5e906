"""Prompt logprobs (SamplingParams.prompt_logprobs): the engine's values against one full forward
of the same model, through chunked prefill, the prefix cache and a batch of several requests."""

import pytest
import torch

from slimserve.runtime.engine.sequence import SamplingError, SamplingParams
from slimserve.runtime.llm import LLM

PROMPTS = [
    list(range(5, 45)),  # 40 tokens: several blocks of 16
    [7, 3, 99, 12, 250, 31, 8, 8, 8, 44, 17, 2, 300, 1, 9, 77, 5, 60],
    [11, 12],
]


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(
        str(tiny_checkpoint),
        dtype="float32",
        max_num_batched_tokens=32,  # the 40-token prompt is prefilled in two chunks
        kv_cache_memory=4 << 20,
        block_size=16,
    )


def full_forward_logprobs(llm: LLM, ids: list[int]) -> list[float]:
    """The logprob of each prompt token i >= 1 from one forward of the whole prompt (the runner
    called directly with every row's logits), independent of the engine's row bookkeeping."""
    runner = llm.engine.runner
    blocks = -(-len(ids) // runner.block_size)
    # the last blocks of the cache: nothing else is running while this is called
    table = list(range(runner.num_blocks - blocks, runner.num_blocks))
    batch = runner.prepare([ids], [0], [table], [False], [range(len(ids))])
    logits = runner.execute(batch)
    llm.engine.block_manager.reset_prefix_cache()  # the scratch blocks were written over
    lp = torch.log_softmax(logits.float(), -1)
    return [lp[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def test_prompt_logprobs_match_a_full_forward(llm):
    outs = llm.generate(
        PROMPTS,
        SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3),
        use_tqdm=False,
    )
    for ids, out in zip(PROMPTS, outs):
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(ids) and plp[0] is None
        want = full_forward_logprobs(llm, ids)
        got = [e[0] for e in plp[1:]]
        assert got == pytest.approx(want, abs=1e-4)
        for e in plp[1:]:
            assert len(e[1]) == 3
            assert list(e[1].values()) == sorted(e[1].values(), reverse=True)
            assert e[0] <= max(e[1].values()) + 1e-6


def test_start_skips_and_keeps_the_prefix_cache(llm):
    ids = PROMPTS[0]
    warm = llm.generate([ids[:33]], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    assert warm[0].outputs[0].finish_reason == "length"
    out = llm.generate(
        [ids],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=34),
        use_tqdm=False,
    )[0]
    # blocks 0-1 (32 tokens) of the context came from the cache; position 33 was computed
    assert out.num_cached_tokens == 32
    assert all(e is None for e in out.prompt_logprobs[:34])
    want = full_forward_logprobs(llm, ids)
    assert [e[0] for e in out.prompt_logprobs[34:]] == pytest.approx(want[33:], abs=1e-4)
    assert all(e[1] == {} for e in out.prompt_logprobs[34:])


def test_start_at_a_block_edge_leaves_that_block_to_compute(llm):
    ids = PROMPTS[0]
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    # the logits of position 31 (block 1) predict token 32: block 1 cannot come from the cache
    out = llm.generate(
        [ids],
        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=32),
        use_tqdm=False,
    )[0]
    assert out.num_cached_tokens == 16
    assert out.prompt_logprobs[32] is not None and out.prompt_logprobs[31] is None


def test_sampled_tokens_are_unchanged_by_prompt_logprobs(llm):
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    with_lp = llm.generate(
        PROMPTS,
        [
            SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1),
            SamplingParams(max_tokens=4, temperature=0),
            SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0),
        ],
        use_tqdm=False,
    )
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in with_lp]
    assert with_lp[1].prompt_logprobs is None


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 0, "prompt_logprobs_start": 0}, "prompt_logprobs_start"),
    ],
)
def test_bad_values_name_the_field(kwargs, field):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field
