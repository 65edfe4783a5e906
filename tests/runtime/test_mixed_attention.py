"""A mixed step (decode rows and prompt chunks) on the Triton ops: the leading one-token
sequences go through the decode kernel, only the prompt chunks through the prefill kernel, and
the result equals the torch twin's attention over the same batch (runtime/layers/ops.py)."""

import dataclasses

import pytest
import torch

from slimserve.kernels import paged_attention
from tests.helpers.paged import mixed_batch

pytest.importorskip("triton")


def _mixed_batch(q_lens, starts, bs, h, h_kv, d, dtype):
    batch, kc, vc, g = mixed_batch(q_lens, starts, bs, h_kv, d, dtype)
    return batch, torch.randn(sum(q_lens), h, d, generator=g).to(dtype), kc, vc


@pytest.mark.parametrize(
    "q_lens,starts,decodes",
    [
        ([1, 1, 1, 9, 20], [5, 30, 0, 0, 16], 3),  # decodes (one at position 0), a prompt, a chunk
        ([1, 7], [40, 3], 1),
        ([12, 1, 5], [0, 9, 2], 0),  # a one-token row after a chunk stays on the prefill kernel
    ],
)
def test_mixed_step_splits_decode_and_prefill_kernels(monkeypatch, q_lens, starts, decodes):
    from slimserve.runtime.layers.ops import TORCH, triton_ops

    batch, q, kc, vc = _mixed_batch(q_lens, starts, 16, 6, 2, 32, torch.float16)
    assert batch.num_decodes == decodes and not batch.decode_only
    calls = {"decode": 0, "prefill": 0}
    for name in calls:
        fn = getattr(paged_attention, f"paged_attention_{name}")

        def counted(*a, _fn=fn, _name=name, **k):
            calls[_name] += 1
            rows = a[0].shape[0]
            assert rows == (decodes if _name == "decode" else q.shape[0] - decodes)
            return _fn(*a, **k)

        monkeypatch.setattr(paged_attention, f"paged_attention_{name}", counted)
    ops = triton_ops()
    got = ops.attention(q, None, None, kc, vc, batch, ops.plan_attention(batch, 16), 0.2, 1.0, 1.0)
    assert calls == {"decode": int(decodes > 0), "prefill": 1}
    want = TORCH.attention(
        q.float(),
        None,
        None,
        kc.float(),
        vc.float(),
        batch,
        TORCH.plan_attention(batch, 16),
        0.2,
        1.0,
        1.0,
    )
    tol = 2 * torch.finfo(torch.float16).eps * float(vc.float().abs().max())
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=0)


def test_engine_puts_one_token_sequences_first():
    from slimserve.runtime.engine.sequence import SamplingParams
    from slimserve.runtime.llm import LLM
    from tests.helpers import DEMO_MODEL

    # b's long prompt goes in chunks of 32 while the short c, admitted after it, already decodes:
    # the scheduler lists b (running longer) before c
    llm = LLM(str(DEMO_MODEL), device="cpu", max_num_batched_tokens=64)
    eng = llm.engine
    eng.scheduler.config = dataclasses.replace(
        eng.scheduler.config, long_prefill_token_threshold=32
    )
    seen = []
    prepare = eng.runner.prepare

    def spy(chunks, *a):
        batch = prepare(chunks, *a)
        lens = [len(c) for c in chunks]
        seen.append((lens, batch.num_decodes))
        return batch

    eng.runner.prepare = spy
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    eng.add_request("b", list(range(40, 240)), params)
    eng.step()  # b's first chunk
    eng.add_request("c", list(range(10, 20)), params)
    while eng.requests:
        eng.step()
    mixed = [(lens, nd) for lens, nd in seen if 1 in lens and any(n > 1 for n in lens)]
    assert mixed, seen
    for lens, nd in seen:
        assert lens == sorted(lens, key=lambda n: n != 1) and nd == lens.count(1), (lens, nd)
