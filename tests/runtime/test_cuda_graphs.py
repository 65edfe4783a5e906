"""The CPU half of the decode CUDA graphs (runtime/worker/cuda_graphs.py): bucket sizes, the padding of
a batch into the static buffers, and that a padded step over those buffers computes the same
logits for the real rows and writes the same KV cache as the unpadded eager step. (Capture and
replay themselves run where CUDA exists: tests/integration/test_gpu.py.)"""

import pytest
import torch

from slimserve.kernels import kv_quant
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.worker.cuda_graphs import DecodeGraphs, bucket_for, graph_batch_sizes
from slimserve.runtime.worker.model_runner import ModelRunner
from tests.helpers import DEMO_MODEL


def test_bucket_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and graph_batch_sizes(256)[-1] == 256
    sizes = graph_batch_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 3, 4, 5, 9, 17, 20, 21)] == [
        1,
        4,
        4,
        8,
        16,
        20,
        20,
        None,
    ]


def _runner(kv_cache_dtype: str = "auto"):
    config = EngineConfig(
        model=str(DEMO_MODEL),
        device="cpu",
        dtype="float32",
        block_size=4,
        kv_cache_memory="2MiB",
        max_num_seqs=8,
        kv_cache_dtype=kv_cache_dtype,
    )
    return ModelRunner(config)


def _prefill(runner, tables):
    """Three sequences of 5, 9 and 2 cached tokens, the same on every runner."""
    g = torch.Generator().manual_seed(0)
    chunks = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in (5, 9, 2)]
    runner.execute(runner.prepare(chunks, [0, 0, 0], tables, [True] * 3))


def _readable(cache: torch.Tensor, bits: int) -> torch.Tensor:
    """The values a cache gives back: int8 / int4 rows dequantized, float caches as they are."""
    if not bits:
        return cache
    return kv_quant.dequantize_rows(cache, 64, bits)  # the demo model's head_dim


@pytest.mark.parametrize("kv", ["auto", "int8", "int4"])
def test_a_padded_decode_step_over_the_static_buffers_equals_the_eager_step(kv):
    """Also with int8 / int4 caches, whose rows (codes, scale, zero) the static step writes in
    place like any other cache."""
    tables = [[3, 1], [0, 2, 5], [4]]
    eager, padded = _runner(kv), _runner(kv)
    bits = eager.kv_bits
    for r in (eager, padded):
        _prefill(r, tables)
    graphs = DecodeGraphs(
        padded.model, padded.kv_caches, 8, max_blocks=6, block_size=4, device=torch.device("cpu")
    )
    # 3 sequences: bucket 4, one padding row
    batch = padded.prepare([[7], [8], [9]], [5, 9, 2], tables, [True] * 3)
    assert graphs.can_run(batch) and graphs.fill(batch) == 4
    assert graphs.slot_mapping[3].item() == -1 and graphs.context_lens[3].item() == 0
    assert graphs.block_tables[:3, 3:].eq(0).all() and graphs.block_tables[3].eq(0).all()
    want = eager.execute(eager.prepare([[7], [8], [9]], [5, 9, 2], tables, [True] * 3))
    got = graphs.run(padded.prepare([[7], [8], [9]], [5, 9, 2], tables, [True] * 3))
    assert got.shape == want.shape == (3, want.shape[1])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the real rows' new K/V land in the same slots (equal up to the matmul's M-dependent
    # rounding); every other slot, the padding row's included, is untouched
    real = {(1, 1), (5, 1), (4, 2)}  # (block, offset) of positions 5, 9 and 2
    # (an int cache: a code may flip where that rounding crosses a step, one step of its row)
    for (ke, ve), (kp, vp) in zip(eager.kv_caches, padded.kv_caches):
        for e, p in ((ke, kp), (ve, vp)):
            step = kv_quant.row_scales(e)[0] * 1.001 if bits else 0.0
            assert ((_readable(p, bits) - _readable(e, bits)).abs() <= step + 1e-5).all()
            differ = {tuple(i) for i in (e != p).any(-1).any(-1).nonzero().tolist()}
            assert differ <= real, differ
    # a smaller step next: stale rows from the bigger one are re-padded
    got1 = graphs.run(padded.prepare([[1]], [6], [tables[0]], [True]))
    want1 = eager.execute(eager.prepare([[1]], [6], [tables[0]], [True]))
    torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)


def test_steps_the_graphs_cannot_take_run_eagerly():
    runner = _runner()
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, 2, max_blocks=2, block_size=4, device=torch.device("cpu")
    )
    prefill = runner.prepare([[1, 2, 3]], [0], [[0]], [True])
    assert not graphs.can_run(prefill)  # a prompt chunk
    too_many = runner.prepare([[1], [2], [3]], [1, 1, 1], [[0], [1], [2]], [True] * 3)
    assert not graphs.can_run(too_many)  # more sequences than the largest bucket
    too_long = runner.prepare([[1]], [9], [[0, 1, 2]], [True])
    assert not graphs.can_run(too_long)  # more blocks than the buffers hold
    assert runner.graphs is None  # never on without CUDA


def test_cuda_graphs_default_on_only_where_they_can_serve():
    """`cuda_graphs` None (the default) turns graphs on for a one-rank CUDA runner on the Triton
    path only; True insists, False never; TP/PP refuse an explicit True and ignore None."""
    from types import SimpleNamespace

    import pytest

    def use(asked, device="cuda", group=None, triton=True, graphs_ok=True) -> bool:
        runner = SimpleNamespace(
            config=SimpleNamespace(cuda_graphs=asked),
            device=torch.device(device),
            group=group,
            model=SimpleNamespace(CUDA_GRAPHS=graphs_ok),
            _triton_on=lambda: triton,
        )
        return ModelRunner._use_cuda_graphs(runner)

    assert use(None) and use(True) and not use(False)
    assert not use(None, triton=False) and use(True, triton=False)  # fp32: twins, unless asked
    assert not use(None, device="cpu") and not use(True, device="cpu")
    assert not use(None, group=object())  # a tensor-parallel rank
    # a model that plans on the host (MoE blocks, windowed/soft-capped attention): never
    assert not use(None, graphs_ok=False) and not use(True, graphs_ok=False)
    assert EngineConfig.__dataclass_fields__["cuda_graphs"].default is None
    with pytest.raises(ValueError, match="cuda_graphs"):
        EngineConfig(model="m", tensor_parallel_size=2, cuda_graphs=True)
