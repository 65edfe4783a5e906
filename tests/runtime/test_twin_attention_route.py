"""The Triton table takes no sliding window and no soft cap (runtime/layers/ops.py): it refuses
them instead of dropping them, and `twin_attention` swaps in the torch twin's plan and attention
(what Gemma 2/3 and windowed Phi-3 attend through on CUDA), keeping every other op."""

import pytest
import torch

from slimserve.runtime.layers import ops
from tests.helpers.paged import mixed_batch

pytest.importorskip("triton")


def test_triton_table_refuses_a_window_and_a_cap():
    table = ops.triton_ops()
    batch, kc, vc, g = mixed_batch([1, 5], [3, 0], 8, 2, 16, torch.float32)
    assert table.plan_attention(batch, 8) is None
    with pytest.raises(ValueError, match="no sliding window"):
        table.plan_attention(batch, 8, 4)
    q = torch.randn(6, 4, 16, generator=g)
    with pytest.raises(ValueError, match="no soft cap"):
        table.attention(q, q[:, :2], q[:, :2], kc, vc, batch, None, 0.25, 1.0, 1.0, softcap=2.0)


def test_twin_attention_keeps_the_other_ops():
    table = ops.triton_ops()
    routed = ops.twin_attention(table)
    assert routed.triton and routed.rms_norm is table.rms_norm
    assert routed.rope_and_write_kv is table.rope_and_write_kv
    assert routed.attention is ops.TORCH.attention
    assert routed.plan_attention is ops.TORCH.plan_attention
    assert ops.twin_attention(ops.CPU) is ops.CPU  # the CPU and torch tables take both already
