"""The CPU ops table (runtime/layers/ops.py): the leading one-token sequences go to the compiled
CPU kernel, the rest to the torch twin, and the step equals the twin's attention over the same
batch; `SLIMSERVE_KERNELS=torch` and a C library that did not build select the twins alone."""

import pytest
import torch

from slimserve.kernels import cpu_attention, cpu_layer_ops
from slimserve.runtime.layers import ops
from tests.helpers.paged import mixed_batch


def _batch(q_lens, starts, bs, h, h_kv, d, dtype):
    batch, kc, vc, g = mixed_batch(q_lens, starts, bs, h_kv, d, dtype, seed=3)
    q = torch.randn(sum(q_lens), h, d, generator=g).to(torch.bfloat16)
    k = torch.randn(sum(q_lens), h_kv, d, generator=g).to(torch.bfloat16)
    return batch, q, k, k.clone(), kc, vc


@pytest.mark.skipif(not cpu_attention.available(), reason="no CPU kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "q_lens,starts,decodes",
    [
        ([1, 1, 1], [5, 30, 0], 3),  # decode only
        ([1, 1, 1, 9, 20], [5, 30, 0, 0, 16], 3),  # decodes, a prompt, a chunk after a prefix
        ([12, 1, 5], [0, 9, 2], 0),  # a one-token row after a chunk stays on the twin
    ],
)
def test_cpu_table_splits_rows_and_matches_the_twin(monkeypatch, dtype, q_lens, starts, decodes):
    batch, q, k, v, kc, vc = _batch(q_lens, starts, 16, 6, 2, 64, dtype)
    calls = []
    real = cpu_attention.paged_attention_decode

    def counted(query, *a, **kw):
        calls.append(query.shape[0])
        return real(query, *a, **kw)

    monkeypatch.setattr(cpu_attention, "paged_attention_decode", counted)
    plan = ops.CPU.plan_attention(batch, 16)
    got = ops.CPU.attention(q, k, v, kc, vc, batch, plan, 0.125, 1.0, 1.0)
    assert calls == [decodes]
    # the twin, on caches it attends the same way; fresh keys only serve prompt chunks without a prefix
    want = ops.TORCH.attention(
        q, k, v, kc, vc, batch, ops.TORCH.plan_attention(batch, 16), 0.125, 1.0, 1.0
    )
    assert got.dtype == q.dtype
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=0)


def test_select_picks_the_cpu_table_only_where_the_kernel_runs(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("SLIMSERVE_KERNELS", "auto")
    built = cpu_attention.available() and cpu_layer_ops.available()
    assert ops.select(cpu) is (ops.CPU if built else ops.TORCH)
    monkeypatch.setattr(cpu_attention, "available", lambda: True)
    monkeypatch.setattr(cpu_layer_ops, "available", lambda: False)
    assert ops.select(cpu) is ops.TORCH
    monkeypatch.setattr(cpu_layer_ops, "available", lambda: True)
    assert ops.select(cpu) is ops.CPU
    monkeypatch.setattr(cpu_attention, "available", lambda: False)
    assert ops.select(cpu) is ops.TORCH
    monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")  # the twins alone: the oracle
    assert ops.select(cpu) is ops.TORCH


def test_auto_runs_fp32_on_cuda_through_the_twins(monkeypatch):
    """The Triton kernels take 16-bit activations: under `auto` an fp32 model on CUDA runs the
    torch twins (the first GPU run found its fp32 cache handed to the Triton KV write), fp16 and
    bf16 the kernels; `triton` forces the kernels whatever the dtype."""
    cuda = torch.device("cuda")
    monkeypatch.setenv("SLIMSERVE_KERNELS", "auto")
    assert not ops.triton_enabled(cuda, torch.float32)
    assert ops.select(cuda, torch.float32) is ops.TORCH
    assert ops.triton_enabled(cuda, torch.bfloat16) and ops.triton_enabled(cuda, torch.float16)
    assert ops.triton_enabled(cuda)  # no dtype: 16-bit
    monkeypatch.setenv("SLIMSERVE_KERNELS", "triton")
    assert ops.triton_enabled(cuda, torch.float32)
