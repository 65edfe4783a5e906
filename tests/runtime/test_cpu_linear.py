"""Dense Linears reordered for oneDNN on CPU (runtime/layers/cpu_linear.py): same results as
F.linear, only plain fp32 Linears replaced (and bf16 ones on a CPU with native bf16), and the
engine's tokens unchanged."""

import pytest
import torch
from torch import nn

from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.layers import cpu_linear
from slimserve.runtime.layers.cpu_linear import PackedLinear, pack_linears
from slimserve.runtime.llm import LLM
from slimserve.runtime.worker import model_runner

pytestmark = pytest.mark.skipif(
    not cpu_linear.available(torch.float32),
    reason="oneDNN's reordered Linear is not available in this torch",
)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_packed_linear_equals_f_linear(bias, rows):
    g = torch.Generator().manual_seed(rows)
    lin = nn.Linear(96, 200, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(200, 96, generator=g))
        if bias:
            lin.bias.copy_(torch.randn(200, generator=g))
    x = torch.randn(rows, 96, generator=g)
    packed = PackedLinear(lin)
    torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-4)
    strided = torch.randn(5, 192, generator=g)[:, ::2]  # a view, not contiguous
    torch.testing.assert_close(packed(strided), lin(strided), rtol=1e-5, atol=1e-4)


def test_pack_linears_replaces_plain_fp32_linears_only(monkeypatch):
    class Sub(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 4), Sub(4, 4)), nn.ReLU())
    assert pack_linears(model, torch.float32) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[1][0], PackedLinear)
    assert type(model[1][1]) is Sub  # a subclass may compute something else: left alone
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda: False)
    cpu_linear.available.cache_clear()
    try:  # emulated bf16 (no native instructions) stays on F.linear; fp16 always does
        for dtype in (torch.bfloat16, torch.float16):
            half = nn.Sequential(nn.Linear(8, 8)).to(dtype)
            assert pack_linears(half, dtype) == 0 and type(half[0]) is nn.Linear
    finally:
        cpu_linear.available.cache_clear()


@pytest.mark.skipif(not cpu_linear.available(torch.bfloat16), reason="this CPU has no native bf16")
def test_packed_bf16_linear_equals_f_linear():
    g = torch.Generator().manual_seed(0)
    lin = nn.Linear(96, 200, bias=True).to(torch.bfloat16)
    x = torch.randn(9, 96, generator=g).to(torch.bfloat16)
    model = nn.Sequential(lin)
    want = lin(x)
    assert pack_linears(model, torch.bfloat16) == 1 and isinstance(model[0], PackedLinear)
    got = model(x)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2e-2)  # bf16 rounding


def test_engine_packs_its_linears_and_keeps_its_tokens(tiny_checkpoint, monkeypatch):
    prompts = [[5, 17, 42, 99, 3, 250], [7] * 40, [300, 2, 11]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="float32")
    model = llm.engine.runner.model
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert (
        sum(isinstance(m, PackedLinear) for m in model.modules()) == 2 * 4 + 1
    )  # qkv/o/gate_up/down + head
    packed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    monkeypatch.setattr(model_runner, "pack_linears", lambda model, dtype: 0)
    plain = LLM(str(tiny_checkpoint), device="cpu", dtype="float32")
    assert any(type(m) is nn.Linear for m in plain.engine.runner.model.modules())
    assert [
        o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)
    ] == packed


def test_row_buckets_pad_little_and_stay_few():
    assert [cpu_linear.bucket_rows(r) for r in (1, 8, 9, 64, 65, 256, 257, 1024, 1025)] == [
        8,
        8,
        16,
        64,
        80,
        256,
        288,
        1024,
        1152,
    ]
    padded = [cpu_linear.bucket_rows(r) for r in range(1, 2049)]
    assert all(p >= r for r, p in zip(range(1, 2049), padded))
    assert all(a <= b for a, b in zip(padded, padded[1:]))
    assert all(
        p - r < max(8, r // 4) for r, p in zip(range(1, 2049), padded)
    )  # under 25% past 32 rows
    assert (
        len(set(padded)) <= 60
    )  # oneDNN primitives per Linear shape, far below its cache of 1,024


def test_padded_rows_leave_the_result_unchanged():
    g = torch.Generator().manual_seed(1)
    lin = nn.Linear(96, 200)
    packed = PackedLinear(lin)
    x = torch.randn(2, 5, 96, generator=g)  # 10 rows, padded to 16
    got = packed(x)
    assert got.shape == (2, 5, 200)
    torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-4)


def test_warm_up_runs_each_shape_once_per_bucket():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(16, 32), nn.Linear(32, 16))
    assert pack_linears(model, torch.float32) == 3
    buckets = len({cpu_linear.bucket_rows(r) for r in range(1, 101)})
    assert cpu_linear.warm_up(model, 100) == 2 * buckets  # two distinct shapes
    cap = len({cpu_linear.bucket_rows(r) for r in range(1, cpu_linear.WARM_UP_ROWS + 1)})
    assert cpu_linear.warm_up(model, 100_000) == 2 * cap
    assert cpu_linear.warm_up(nn.Sequential(nn.ReLU()), 100) == 0
