"""Kernel launches per decoder layer per decode step (issue 12): at most 10 with dense weights,
counted by instrumenting the op dispatch on CPU, not by reading code.

"Launch" is defined in tests/helpers/launches.py: one Triton kernel launch, or one aten op
dispatch that is not a pure view/metadata op or an uninitialized allocation. The model runs with
SLIMSERVE_KERNELS=triton through the Triton interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py on machines without a GPU), so every op that has a kernel goes through it and
the rest (the dense GEMMs, which are cuBLAS calls on a GPU) are aten ops: what a GPU would launch.

The budget, per layer, in order: norm+residual, qkv GEMM, fused RoPE + KV write, attention,
o GEMM, norm+residual, gate/up GEMM, silu*mul, down GEMM (9; 10 allowed). Split-K and
split-context reduction passes are shown but not budgeted. W4A16 layers may add nothing else;
W8A8 layers may add one activation-quant launch per quantized GEMM (4).

The counts are taken in float16: the interpreter runs bf16 too, but every launcher and twin
treats the two alike (no dtype-dependent casts), so the count does not depend on it; a bf16
dense run is included to show it.
"""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

import pytest
import torch

from slimserve.eval.engine_bench import quantize_randomly
from slimserve.runtime.batch import prepare_batch
from slimserve.runtime.models.fuse import fuse_projections
from slimserve.runtime.models.llama import ModelSpec
from slimserve.runtime.models.load import random_model
from tests.helpers.launches import budget_launches, count_launches, table

pytest.importorskip("triton")

BUDGET = 10
# quantized GEMMs per layer (qkv, o, gate/up, down) and the activation-quant launches each adds
QUANT_GEMMS = 4
EXTRA = {"dense": 0, "W4A16": 0, "W8A8": QUANT_GEMMS}

SPEC = ModelSpec(
    model_type="llama",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
    qk_norm=False,
    tie_word_embeddings=False,
    sliding_window=None,
    inv_freq=tuple((1.0 / 10000 ** (torch.arange(0, 32, 2).float() / 32)).tolist()),
)


@contextlib.contextmanager
def no_backend_lookups():
    """Fail if the forward re-resolves the kernel backend (reads SLIMSERVE_KERNELS) or imports a
    module by name: both are resolved at the model's first forward and kept."""

    def refuse(*_a, **_k):
        raise AssertionError("the kernel backend was looked up again on the hot path")

    with contextlib.ExitStack() as stack:
        for target in (
            "slimserve.kernels._launch.kernel_backend",
            "slimserve.runtime.layers.ops.kernel_backend",
            "slimserve.runtime.layers.quant_linear.use_triton",
            "slimserve.kernels.w4a16_gemm.use_triton",
        ):
            importlib.import_module(target.rsplit(".", 1)[0])
            stack.enter_context(mock.patch(target, refuse))
        real_import = importlib.import_module

        def import_module(name, package=None):  # torch imports its own submodules lazily
            if name.startswith("slimserve"):
                refuse()
            return real_import(name, package)

        stack.enter_context(mock.patch("importlib.import_module", import_module))
        yield


def decode_launches(weights: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
    """Per-layer launch lists of one decode step (2 sequences, contexts 7 and 3) of a random
    2-layer model, and the "model"-scope list."""
    model = random_model(SPEC, dtype, torch.device("cpu"))
    if weights != "dense":
        quantize_randomly(model, group_size=128, seed=1, scheme_name=weights)
    fuse_projections(model)
    model.eval()
    block_size, blocks = 16, 4
    shape = (blocks, block_size, SPEC.num_kv_heads, SPEC.head_dim)
    caches = [
        (torch.randn(shape).to(kv_dtype or dtype), torch.randn(shape).to(kv_dtype or dtype))
        for _ in range(SPEC.num_layers)
    ]
    batch = prepare_batch(
        [[5], [9]], [6, 2], [[1], [3]], [True, True], block_size, torch.device("cpu")
    )
    assert batch.decode_only
    model(batch, caches)  # warm-up: lazy weight repacks (W4A16) happen on the first forward
    with no_backend_lookups(), count_launches(model) as counter:
        logits = model(batch, caches)
    assert torch.isfinite(logits).all()
    layers = [counter.ops(f"layer{i}") for i in range(SPEC.num_layers)]
    return layers, counter.ops("model")


def _report(name: str, layers: list[list[str]], model_ops: list[str]) -> str:
    return (
        f"{name}: launches of layer 0 ({budget_launches(layers[0])} budgeted, "
        f"{len(layers[0])} in all):\n{table(layers[0])}\n"
        f"once per step, outside the layers ({len(model_ops)}):\n{table(model_ops)}"
    )


@pytest.fixture
def triton_path(monkeypatch):
    monkeypatch.setenv("SLIMSERVE_KERNELS", "triton")


@pytest.mark.parametrize("weights", ["dense", "W4A16", "W8A8"])
def test_decode_launches_per_layer(triton_path, weights):
    layers, model_ops = decode_launches(weights, torch.float16)
    dense, _ = decode_launches("dense", torch.float16) if weights != "dense" else (layers, None)
    msg = _report(weights, layers, model_ops)
    assert layers[0] == layers[1], msg  # every layer launches the same kernels
    assert budget_launches(layers[0]) <= BUDGET + EXTRA[weights], msg
    # quantized layers add at most their activation-quant launches over the dense layer
    extra = budget_launches(layers[0]) - budget_launches(dense[0])
    assert extra <= EXTRA[weights], msg + "\n\ndense:\n" + table(dense[0])
    if weights == "W8A8":
        assert layers[0].count("triton._act_quant_kernel") <= QUANT_GEMMS, msg


def test_decode_launches_bf16_and_fp8_kv(triton_path):
    """The count does not move with the compute dtype (bf16) or an fp8 KV cache."""
    want, _ = decode_launches("dense", torch.float16)
    for dtype, kv in ((torch.bfloat16, None), (torch.float16, torch.float8_e4m3fn)):
        layers, model_ops = decode_launches("dense", dtype, kv)
        assert layers[0] == want[0], _report(f"{dtype}, kv {kv}", layers, model_ops)
