"""Load-time layout of W4A16 / W8A16 weights for kernels/w4a16_gemm.py.

CT pack-quantized tensors (docs/architecture.md, "The safetensors"), for weight_shape = (N, K),
b = num_bits in {4, 8}:
  weight_packed      int32 [N, ceil(K*b/32)]: 32/b offset-binary codes per word along K, lowest
                     k in the low bits; signed code q = field - 2^(b-1).
  weight_scale       fp16/bf16/fp32 [N, G], G = ceil(K / group_size) (1: per channel; [1]: per
                     tensor).
  weight_zero_point  int32 [ceil(N*b/32), G] packed the same way along N, or None (symmetric).
  weight_g_idx       int32 [K] (actorder "group"): column k uses scale column g_idx[k], or None.

`prepare_w4a16` turns these into `W4A16Weight`: the same words transposed to [K words, N] so a
tile's loads run along N, scales and zero points transposed to [G, N] (zero points unpacked to
int8), and act-order resolved at load time by sorting K by group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimserve.kernels import reference
from slimserve.kernels._launch import check, check_tensor

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, eq=False)
class W4A16Weight:
    """Kernel layout of a pack-quantized weight; K is in "sorted" order when perm is set."""

    qweight: torch.Tensor  # int32 [ceil(K*b/32), N]: CT's words transposed: loads along N coalesce
    scales: torch.Tensor  # [G, N] in the checkpoint's scale dtype
    zeros: torch.Tensor | None  # int8 [G, N] signed zero points; None = symmetric
    perm: torch.Tensor | None  # int32 [K]: sorted position -> original column of x (act-order)
    group_idx: torch.Tensor | None  # int32 [K]: group of each sorted position, when groups are
    #                                 not contiguous runs of group_size (kernel gathers scales)
    n: int  # out_features
    k: int  # in_features
    group_size: int  # columns per group in sorted order; 0 = one group (per channel)
    num_bits: int  # 4 or 8


def _permute_packed(
    packed: torch.Tensor, num_bits: int, k: int, order: torch.Tensor
) -> torch.Tensor:
    """CT words [N, W] repacked with their K codes reordered: column j <- column order[j]."""
    pack = 32 // num_bits
    unpack = reference.unpack_int4_weight if num_bits == 4 else reference.unpack_int8_weight
    fields = torch.zeros(
        packed.shape[0], packed.shape[1] * pack, dtype=torch.int32, device=packed.device
    )
    fields[:, :k] = unpack(packed, k)[:, order] + (1 << (num_bits - 1))
    fields = fields.reshape(packed.shape[0], -1, pack)
    words = fields[..., 0]
    for j in range(1, pack):  # disjoint bit fields; the top one wraps into int32's sign bit
        words = words | (fields[..., j] << (j * num_bits))
    return words


def prepare_w4a16(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    weight_shape: torch.Tensor | tuple[int, int],
    group_size: int | None,
    num_bits: int = 4,
) -> W4A16Weight:
    """Load-time repack of CT pack-quantized tensors (module docstring) into `W4A16Weight`.

    Act-order g_idx is handled by sorting K by group (stable): groups become contiguous, x's
    columns are gathered by `perm` at run time, and scales load once per tile when every group is
    a run of group_size columns (GPTQ's case); otherwise the kernel gathers scales by group_idx.
    """
    check(num_bits in (4, 8), lambda: f"num_bits={num_bits} is not supported; use 4 or 8")
    n, k = (int(v) for v in weight_shape)
    dev = weight_packed.device
    check_tensor(
        "weight_packed", weight_packed, dtypes=(torch.int32,), shape=(n, -(-k * num_bits // 32))
    )
    check_tensor("weight_scale", weight_scale, dtypes=SCALE_DTYPES, device=dev)
    scale = weight_scale.reshape(1, 1).expand(n, 1) if weight_scale.numel() == 1 else weight_scale
    check_tensor("weight_scale", scale, ndim=2, shape=(n, None))
    groups = scale.shape[1]
    if groups == 1:
        group_size = 0
    elif weight_g_idx is None:
        check(
            bool(group_size) and groups == -(-k // group_size),
            lambda: (
                f"weight_scale has {groups} groups for K={k} but "
                f"group_size={group_size}; pass "
                f"the scheme's group_size (K / groups rounded up) or a weight_g_idx"
            ),
        )
    perm = gidx = None
    qweight = weight_packed  # CT's word w already holds k = w * 32/b + field: only transposed
    if weight_g_idx is not None:
        check_tensor(
            "weight_g_idx", weight_g_idx, dtypes=(torch.int32, torch.int64), shape=(k,), device=dev
        )
        check(
            k == 0 or 0 <= int(weight_g_idx.min()) and int(weight_g_idx.max()) < groups,
            lambda: f"weight_g_idx values must lie in [0, {groups}) (weight_scale's groups)",
        )
        order = torch.sort(weight_g_idx.long(), stable=True)
        regular = bool(group_size) and torch.equal(
            order.values, torch.arange(k, device=dev) // group_size
        )
        if groups > 1 and not regular:
            gidx, group_size = order.values.to(torch.int32), 0
        if not torch.equal(order.indices, torch.arange(k, device=dev)):
            perm = order.indices.to(torch.int32)
            qweight = _permute_packed(weight_packed, num_bits, k, order.indices)
    if gidx is None and group_size and group_size % 16:  # no pow2 tile >= 16 fits in a group
        gidx = (torch.arange(k, device=dev) // group_size).to(torch.int32)
    zeros = None
    if weight_zero_point is not None:  # [N, G] signed -> int8 [G, N]
        check_tensor(
            "weight_zero_point",
            weight_zero_point,
            dtypes=(torch.int32,),
            shape=(-(-n * num_bits // 32), groups),
            device=dev,
        )
        zeros = reference.unpack_zero_point(weight_zero_point, num_bits, n).to(torch.int8)
        zeros = zeros.t().contiguous()
    return W4A16Weight(
        qweight.t().contiguous(),
        scale.t().contiguous(),
        zeros,
        perm,
        gidx,
        n,
        k,
        int(group_size or 0),
        num_bits,
    )


def dequantize_torch(w: W4A16Weight) -> torch.Tensor:
    """fp32 [N, K], checkpoint column order, from the prepared layout: the CPU path of the
    kernels (the same exact fp32 arithmetic as reference.dequantize_packed)."""
    pack = 32 // w.num_bits
    shifts = torch.arange(pack, device=w.qweight.device, dtype=torch.int32) * w.num_bits
    fields = (w.qweight[:, None, :] >> shifts[None, :, None]) & ((1 << w.num_bits) - 1)
    q = fields.reshape(-1, w.n)[: w.k].float() - (1 << (w.num_bits - 1))  # [K, N] sorted order
    g = (
        w.group_idx.long()
        if w.group_idx is not None
        else torch.arange(w.k, device=q.device) // (w.group_size or max(w.k, 1))
    )
    if w.zeros is not None:
        q = q - w.zeros.float()[g]
    wt = q * w.scales.float()[g]
    if w.perm is not None:
        wt = torch.empty_like(wt).index_copy_(0, w.perm.long(), wt)
    return wt.t().contiguous()
