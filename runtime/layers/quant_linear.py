"""A Linear that holds compressed-tensors buffers and computes with them.

The buffers have CT's on-disk names, so an artifact's safetensors load straight into
`model.load_state_dict`. Paths, by device and kernel backend (kernels/_launch.py):
- Triton (CUDA, or forced): pack-quantized 4/8-bit weights run the fused W4A16/W8A16 GEMM on a
  load-time repack (`prepare_w4a16`, built on first use); W8A8 int-quantized weights run dynamic
  per-token int8 activations through the int8 GEMM.
- torch: the weight is rebuilt per forward in fp32 and cast once to the activation dtype, which
  reproduces the exporter's fake-quantized weight bit for bit; `freeze_dense()` keeps that
  weight instead (the serving engine's CPU path, where no int4 kernel exists and dequantizing
  every step would dominate), trading the packed form's memory saving for speed; on an fp32
  CPU it is kept reordered for oneDNN (runtime/layers/cpu_linear.py). A W8A8 layer on CPU keeps
  its int8 codes instead and runs the int8 GEMM (runtime/layers/cpu_quant_linear.py).
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
from torch import nn

from slimserve.kernels import reference
from slimserve.kernels._launch import use_triton
from slimserve.runtime.artifact.scheme import QuantScheme
from slimserve.runtime.layers import cpu_linear, cpu_quant_linear

PACKED = "pack-quantized"
UNPACKED = ("naive-quantized", "int-quantized")


@functools.cache
def _kernels() -> SimpleNamespace:
    """The GEMM launchers, imported once on first use (triton is not imported on the torch path)."""
    from slimserve.kernels.w4a16_gemm import prepare_w4a16, w4a16_gemm
    from slimserve.kernels.w8a8_gemm import linear_w8a8

    return SimpleNamespace(
        prepare_w4a16=prepare_w4a16, w4a16_gemm=w4a16_gemm, linear_w8a8=linear_w8a8
    )


class QuantLinear(nn.Module):
    """y = x @ W^T + b with W stored as CT pack-/naive-/int-quantized buffers."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        scheme: QuantScheme,
        ct_format: str,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
        num_groups: int | None = None,
    ) -> None:
        """num_groups: scale/zero-point columns when they are not ceil(in_features / group_size):
        a tensor-parallel slice of an act-order layer's input columns keeps every group
        (runtime/distributed/sharding.py)."""
        super().__init__()
        w = scheme.weights
        if w.type != "int" or ct_format not in (PACKED, *UNPACKED):
            raise ValueError(
                f"QuantLinear supports int weights in formats {PACKED}, "
                f"{', '.join(UNPACKED)}; got type={w.type!r}, format={ct_format!r}"
            )
        if ct_format == PACKED and not 1 <= w.num_bits <= 8:
            raise ValueError(f"pack-quantized holds 1 to 8 bits, got num_bits={w.num_bits}")
        if ct_format == PACKED and w.strategy == "tensor" and not w.symmetric:
            raise ValueError(
                "pack-quantized with one asymmetric zero point per tensor is not "
                "supported; use strategy 'channel' or 'group'"
            )
        acts = scheme.input_activations
        if acts is not None and not (
            acts.type == "int"
            and acts.num_bits == 8
            and acts.dynamic
            and acts.strategy == "token"
            and acts.symmetric
        ):
            raise ValueError(
                f"input activations {acts} are not supported; only dynamic symmetric "
                "per-token int8 (W8A8) is"
            )
        self.in_features, self.out_features = in_features, out_features
        # dtype of the checkpoint's scales: the dequantized weight is rounded to it once, so a
        # float32 model computes with exactly the weight a bf16/fp16 loader would hold.
        self.storage_dtype = dtype
        self.scheme, self.ct_format = scheme, ct_format
        n, k, b = out_features, in_features, w.num_bits
        groups = -(-k // w.group_size) if w.strategy == "group" else 1
        groups = num_groups if num_groups is not None else groups
        qshape = (1,) if w.strategy == "tensor" else (n, groups)  # CT: one scale per tensor is [1]
        kw = {"device": device}
        if ct_format == PACKED:
            self.register_buffer(
                "weight_packed", torch.zeros(n, -(-k * b // 32), dtype=torch.int32, **kw)
            )
            self.register_buffer(
                "weight_shape", torch.tensor([n, k], dtype=torch.int64, device=device)
            )
            zp = torch.zeros(-(-n * b // 32), groups, dtype=torch.int32, **kw)  # packed along N
        else:
            self.register_buffer("weight", torch.zeros(n, k, dtype=torch.int8, **kw))
            zp = torch.zeros(qshape, dtype=torch.int8, **kw)
        self.register_buffer("weight_scale", torch.ones(qshape, dtype=dtype, **kw))
        self.register_buffer("weight_zero_point", None if w.symmetric else zp)
        g_idx = torch.zeros(k, dtype=torch.int32, **kw) if w.actorder == "group" else None
        self.register_buffer("weight_g_idx", g_idx)
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, **kw) if bias else None)

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """[N, K] weight in `dtype`: fp32 arithmetic, rounded to the storage dtype, then cast."""
        if self.__dict__.get("_released"):
            raise RuntimeError(
                "this layer's compressed-tensors buffers were released after the "
                "W4A16 repack at load (runtime/worker/model_runner.py); only the kernel "
                "path (fp16/bf16 inputs) can run it"
            )
        w = self.scheme.weights
        if self.ct_format == PACKED:
            full = reference.dequantize_packed(
                self.weight_packed,
                self.weight_scale,
                self.weight_zero_point,
                self.weight_g_idx,
                (self.out_features, self.in_features),
                w.num_bits,
                w.group_size,
            )
        else:
            full = reference.dequantize_codes(
                self.weight,
                self.weight_scale,
                self.weight_zero_point,
                self.weight_g_idx,
                w.group_size,
            )
        return full.to(self.storage_dtype).to(dtype)

    def freeze_dense(self, dtype: torch.dtype) -> None:
        """Keep the dequantized weight in `dtype` for the torch path (see the module docstring),
        or for W8A8 on CPU the int8 codes for the int8 GEMM."""
        device = self.weight_scale.device
        g_idx = self.weight_g_idx is not None
        if cpu_quant_linear.serves(self.scheme, self.ct_format, g_idx, device, dtype):
            self._int8 = cpu_quant_linear.prepare(self.weight, self.weight_scale, self.bias)
            return
        dense = self.dequantized_weight(dtype)
        if dense.device.type == "cpu" and cpu_linear.available(dtype):
            self._packed = cpu_linear.reorder(dense)
        else:
            self._dense = dense

    def prepare_kernel(self, release: bool = True) -> None:
        """Repack for the Triton W4A16 kernel now instead of on the first request and, with
        `release`, drop the compressed-tensors buffers the repacked copy replaces, so the layer
        holds its weights once (afterwards only the kernel path, fp16/bf16 inputs, can run it).
        W8A8 runs on its buffers as they are: nothing to do."""
        if self._kernel_path() != "w4a16" or "_prepared" in self.__dict__:
            return
        w = self.scheme.weights
        self._prepared = _kernels().prepare_w4a16(
            self.weight_packed,
            self.weight_scale,
            self.weight_zero_point,
            self.weight_g_idx,
            (self.out_features, self.in_features),
            w.group_size,
            w.num_bits,
        )
        if not release:
            return
        for name in ("weight_packed", "weight_scale", "weight_zero_point", "weight_g_idx"):
            buf = getattr(self, name)
            if buf is not None:
                setattr(self, name, buf.new_empty(0))  # still a registered buffer, now empty
        self._released = True

    def _kernel_path(self) -> str | None:
        """'w4a16' | 'w8a8' | None: the Triton kernel that serves this layer's format."""
        w, acts = self.scheme.weights, self.scheme.input_activations
        if acts is not None:
            ok = (
                self.ct_format == "int-quantized"
                and w.num_bits == 8
                and w.symmetric
                and w.strategy == "channel"
            )
            return "w8a8" if ok else None
        if self.ct_format == PACKED and w.num_bits in (4, 8) and w.strategy in ("group", "channel"):
            return "w4a16"
        return None

    def _triton_forward(self, x: torch.Tensor, path: str) -> torch.Tensor:
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        kernels = _kernels()
        if path == "w8a8":
            return kernels.linear_w8a8(x.contiguous(), self.weight, self.weight_scale, bias)
        if "_prepared" not in self.__dict__:  # a model outside the engine: keep its buffers
            self.prepare_kernel(release=False)
        return kernels.w4a16_gemm(x.contiguous(), self._prepared, bias, use_kernel=True)

    def _route(self, x: torch.Tensor) -> str | None:
        """The kernel path for inputs on x's device, resolved once per device (reading
        SLIMSERVE_KERNELS then) and kept: 'w4a16' | 'w8a8' | None (the torch path)."""
        route = self.__dict__.get("_routed")
        if route is None or route[0] != x.device:
            path = self._kernel_path() if use_triton(x) else None
            route = self.__dict__["_routed"] = (x.device, path)
        return route[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., K] -> [..., N]
        path = self._route(x)
        if path is not None and x.dtype in (torch.float16, torch.bfloat16):
            return self._triton_forward(x, path)
        int8 = self.__dict__.get("_int8")
        if (
            int8 is not None
            and x.device.type == "cpu"
            and x.dtype in cpu_quant_linear.COMPUTE_DTYPES
        ):
            return cpu_quant_linear.linear(x, int8)
        if self.scheme.input_activations is not None:
            x = reference.fake_quantize_per_token_int8(x)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        packed = getattr(self, "_packed", None)
        if packed is not None and x.dtype == packed.dtype:
            return cpu_linear.linear(x, packed, bias)
        dense = getattr(self, "_dense", None)
        weight = dense.to(x.dtype) if dense is not None else self.dequantized_weight(x.dtype)
        return nn.functional.linear(x, weight, bias)

    def extra_repr(self) -> str:
        w = self.scheme.weights
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.ct_format}, bits={w.num_bits}, strategy={w.strategy}, "
            f"group_size={w.group_size}, symmetric={w.symmetric}"
        )
