"""The CUDA paths, against the CPU path on the same inputs (marker `gpu`: `pytest -m gpu` on a
machine with a GPU; the default run deselects them and CPU-only machines skip them).

Both sides run float32 with TF32 off, so they differ only by summation order: greedy tokens of
the trained demo model agree, and perplexities agree to a relative 1e-4.
"""

import math

import pytest
import torch

from slimserve.compress.pipeline import run_recipe
from slimserve.compress.recipe import parse_recipe
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.llm import LLM
from tests.helpers import DEMO_MODEL

pytestmark = pytest.mark.gpu

PROMPTS = [
    "def add(a, b):\n    return",
    "class Point:\n    def __init__(self, x, y):\n",
    "for i in range(10):\n",
]


@pytest.fixture(autouse=True)
def _no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _greedy(device: str, **engine_args) -> list[list[int]]:
    llm = LLM(str(DEMO_MODEL), device=device, dtype="float32", **engine_args)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_engine_on_cuda_matches_cpu_greedy():
    assert _greedy("cuda", kv_cache_memory="256MiB", max_num_batched_tokens=16) == _greedy("cpu")


def test_cuda_graph_replay_gives_the_eager_tokens():
    """Decode steps replayed from CUDA graphs (runtime/worker/cuda_graphs.py) against eager steps, fp16
    on the kernel path, with batches that fall between buckets (padding rows)."""
    kw = dict(device="cuda", dtype="float16", kv_cache_memory="256MiB", max_num_seqs=6)
    llm = LLM(str(DEMO_MODEL), cuda_graphs=True, **kw)
    assert sorted(llm.engine.runner.graphs.graphs) == [1, 2, 4, 6]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    graphed = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    eager = [
        o.outputs[0].token_ids
        for o in LLM(str(DEMO_MODEL), cuda_graphs=False, **kw).generate(
            PROMPTS, params, use_tqdm=False
        )
    ]
    assert graphed == eager
    # the default: graphs on for fp16/bf16 on one GPU, off for fp32 (the torch twins serve it)
    assert LLM(str(DEMO_MODEL), **kw).engine.runner.graphs is not None
    assert LLM(str(DEMO_MODEL), **{**kw, "dtype": "float32"}).engine.runner.graphs is None


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_int_kv_cache_on_the_kernel_path(kv):
    """fp16 on the Triton path (the fused RoPE + quantizing write, paged decode and chunked
    prefill over int rows) with an int8 / int4 cache: decode steps replayed from CUDA graphs give
    the eager tokens, and the eager tokens those of the CPU's C kernels and twins on the same
    cache (fp32 there; int8 agrees on nearly every token, the check that both read the same
    codes back)."""
    kw = dict(device="cuda", dtype="float16", kv_cache_memory="256MiB", max_num_seqs=6)
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    graphed = LLM(str(DEMO_MODEL), kv_cache_dtype=kv, cuda_graphs=True, **kw)
    assert graphed.engine.runner.kv_bits == int(kv[3:])
    eager = tokens(LLM(str(DEMO_MODEL), kv_cache_dtype=kv, cuda_graphs=False, **kw))
    assert tokens(graphed) == eager
    if kv == "int8":
        cpu = _greedy("cpu", kv_cache_dtype=kv)
        same = sum(a == b for x, y in zip(cpu, eager) for a, b in zip(x, y))
        assert same >= 0.9 * sum(map(len, cpu)), (cpu, eager)


def test_mixed_kv_cache_on_the_kernel_path():
    """fp16 on the Triton path with an fp8 cache whose layers are all kept unquantized serves the
    unquantized cache's tokens; one kept layer gives per-layer cache dtypes and still serves."""
    kw = dict(device="cuda", dtype="float16", kv_cache_memory="256MiB")
    params = SamplingParams(max_tokens=24, temperature=0.0)

    def tokens(llm):
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]

    plain = tokens(LLM(str(DEMO_MODEL), **kw))
    layers = ",".join(map(str, range(4)))  # the demo model's 4 layers
    assert (
        tokens(LLM(str(DEMO_MODEL), kv_cache_dtype="fp8_e4m3", kv_cache_skip_layers=layers, **kw))
        == plain
    )
    mixed = LLM(str(DEMO_MODEL), kv_cache_dtype="fp8_e4m3", kv_cache_skip_layers="1", **kw)
    assert [k.dtype for k, _ in mixed.engine.runner.kv_caches] == [
        torch.float16 if i == 1 else torch.float8_e4m3fn for i in range(4)
    ]
    assert all(len(t) == 24 for t in tokens(mixed))


def test_engine_on_second_gpu_stays_there():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    before = torch.cuda.memory_allocated(0)
    assert _greedy("cuda:1", kv_cache_memory="256MiB") == _greedy("cpu")
    assert torch.cuda.memory_allocated(0) == before


RECIPE = """
model: {model}
output: {out}
device: {device}
eval: {{dataset: stdlib, seq_len: 64, max_windows: 6, max_ppl_increase: 0.5}}
calibration: {{dataset: stdlib, num_samples: 8, seq_len: 64}}
stages:
  - gptq: {{scheme: W4A16, group_size: 32}}
  - kv_cache: {{}}
"""


def _run(tmp_path, model, device):
    text = RECIPE.format(model=model, out=tmp_path / device.replace(":", "_"), device=device)
    return run_recipe(parse_recipe(text, tmp_path / "r.yaml"), log=lambda m: None, progress=False)


def test_compress_on_cuda_matches_cpu(tmp_path, tiny_checkpoint):
    """Layer-by-layer calibration on the GPU gives the CPU's perplexities (baseline, each stage)."""
    cpu, gpu = _run(tmp_path, tiny_checkpoint, "cpu"), _run(tmp_path, tiny_checkpoint, "cuda")
    a, b = cpu.summary, gpu.summary
    assert math.isclose(a["baseline"]["ppl"], b["baseline"]["ppl"], rel_tol=1e-4)
    for sa, sb in zip(a["stages"], b["stages"]):
        assert math.isclose(sa["ppl"], sb["ppl"], rel_tol=1e-3), (sa["name"], sa["ppl"], sb["ppl"])
