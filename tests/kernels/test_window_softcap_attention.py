"""Sliding windows and soft-capped scores (Gemma 2 / 3, Phi-3) in the torch twin's paged
attention (kernels/reference_attention.py) and the C decode kernel (kernels/cpu_attention.c),
against a dense per-query oracle written from transformers' eager attention: scores scaled,
capped to c * tanh(s / c), masked to keys at positions p - window < j <= p, softmax."""

from __future__ import annotations

import pytest
import torch

from slimserve.kernels import cpu_attention as ca
from slimserve.kernels import reference_attention as ra
from tests.helpers.paged import mixed_batch


def _oracle(q, kc, vc, batch, scale, window, softcap):
    """Per sequence, per query: the keys it sees gathered from its blocks, dense math in fp64."""
    bs, hkv = kc.shape[1], kc.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    cu, ctx = batch.cu_seqlens_q.tolist(), batch.context_lens.tolist()
    for b in range(len(ctx)):
        c, n = ctx[b], cu[b + 1] - cu[b]
        blocks = batch.block_tables[b, : -(-c // bs)].long()
        k = kc[blocks].reshape(-1, hkv, kc.shape[-1])[:c].double()
        v = vc[blocks].reshape(-1, hkv, vc.shape[-1])[:c].double()
        rep = q.shape[1] // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        for i in range(n):
            p = c - n + i
            lo = 0 if window is None else max(0, p - window + 1)
            s = torch.einsum("hd,khd->hk", q[cu[b] + i].double(), k[lo : p + 1]) * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            out[cu[b] + i] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[lo : p + 1])
    return out


CASES = [
    # (q_lens, starts): decodes past and inside the window, a prompt longer than the window,
    # a chunk after a prefix that crosses the window's edge
    ([1, 1, 1, 1, 30, 12], [3, 40, 7, 70, 0, 25]),
]


@pytest.mark.parametrize("window", [None, 8, 13])
@pytest.mark.parametrize("softcap", [None, 0.5])
@pytest.mark.parametrize("q_lens,starts", CASES)
def test_twin_applies_the_window_and_the_cap(q_lens, starts, window, softcap):
    batch, kc, vc, g = mixed_batch(q_lens, starts, 8, 2, 16, torch.float32, seed=5)
    q = torch.randn(sum(q_lens), 4, 16, generator=g) * 3  # scores well beyond the cap
    plan = ra.plan_attention(batch.cu_seqlens_q, batch.context_lens, batch.block_tables, 8, window)
    got = ra.paged_attention(q, kc, vc, plan, 0.3, softcap=softcap)
    want = _oracle(q, kc, vc, batch, 0.3, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    if window is not None or softcap is not None:  # the window and the cap change the result
        plain = ra.paged_attention(
            q,
            kc,
            vc,
            ra.plan_attention(batch.cu_seqlens_q, batch.context_lens, batch.block_tables, 8),
            0.3,
        )
        assert (plain - got).abs().max() > 1e-2


needs_kernel = pytest.mark.skipif(not ca.available(), reason="no C compiler here")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 17, 300])
@pytest.mark.parametrize("softcap", [None, 0.7])
@pytest.mark.parametrize("bs", [4, 16])
def test_c_decode_kernel_matches_the_twin(dtype, window, softcap, bs):
    lens = [1, 3, 16, 17, 40, 100]
    batch, kc, vc, g = mixed_batch([1] * len(lens), [n - 1 for n in lens], bs, 2, 64, dtype, 9)
    q = (torch.randn(len(lens), 6, 64, generator=g) * 2).to(dtype)
    got = ca.paged_attention_decode(
        q, kc, vc, batch.block_tables, batch.context_lens, 0.2, window=window, softcap=softcap
    )
    want = _oracle(q.float(), kc.float(), vc.float(), batch, 0.2, window, softcap)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("window", [None, 5, 17, 40])
def test_c_decode_kernel_windows_many_sequences(window):
    """Enough sequences that a task is a whole sequence (its bf16 blocks copied out first from
    the window's first block on: kernels/cpu_attention.c `gather_blocks`)."""
    lens = [1, 3, 16, 17, 40, 100, 64, 65, 90, 31]
    batch, kc, vc, g = mixed_batch(
        [1] * len(lens), [n - 1 for n in lens], 16, 2, 64, torch.bfloat16, 9
    )
    q = (torch.randn(len(lens), 6, 64, generator=g) * 2).to(torch.bfloat16)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        got = ca.paged_attention_decode(
            q, kc, vc, batch.block_tables, batch.context_lens, 0.2, window=window
        )
    finally:
        torch.set_num_threads(before)
    want = _oracle(q.float(), kc.float(), vc.float(), batch, 0.2, window, None)
    torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


@needs_kernel
def test_c_decode_kernel_refuses_a_zero_window():
    batch, kc, vc, g = mixed_batch([1], [4], 4, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="window 0"):
        ca.paged_attention_decode(
            torch.ones(1, 1, 16), kc, vc, batch.block_tables, batch.context_lens, 1.0, window=0
        )
