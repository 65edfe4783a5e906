"""Paged attention over the block KV cache: decode (one query per sequence) and chunked prefill.

Twins: `reference_attention.paged_attention_decode` / `_prefill`. Caches [num_blocks, block_size, Hkv, D]
are fp16/bf16 or fp8 e4m3 codes with per-layer scales, or int8 / int4 rows [.., Hkv, row bytes]
with a scale and zero per token and KV head (kernels/kv_quant.py); block_tables int32
[B, max_blocks].

A program owns one KV head of one sequence and every query head of its GQA group, so each KV
tile is read once per group: decode stacks the G = H / Hkv heads as rows of a [BLOCK_G >= 16, D]
tile (tl.dot needs 16 rows), prefill stacks (query token, head) pairs as rows of [BLOCK_M, D].
Scores and the online softmax (base 2) are fp32; P is rounded to the KV dtype for P @ V into an
fp32 accumulator. fp8 tiles decode with integer ops to fp16 holding 2^-8 x value (exact, see
kv_cache.fp8_e4m3_decode_scaled); 2^8 x k_scale folds into the score scale and 2^8 x v_scale
into the output, so no per-element multiply. int8 / int4 tiles are never dequantized element by
element either: their codes (integers <= 255, exact in fp16 and bf16) go into the dots and each
token's scale s and zero z are applied around them (`_attend_codes`): q.k = s (q.codes) +
z sum(q), and P @ V = (P s) @ codes + P z, with P s carried at 2^8 x its value so fp16 keeps
small weights out of its subnormals (the 2^-8 is taken back at the end, exactly).

Decode splits long contexts (flash-decoding) when (sequence, KV head) programs are too few for
the GPU: partitions of `partition` tokens each write fp32 partials (acc, max, sum), a reduce
kernel combines them. Prefill never loads KV tiles past a query tile's last position and masks
only the tiles that cross the diagonal.

Under TRITON_INTERPRET (triton 3.9: bf16 tl.dot is wrong, fp32 -> bf16 casts truncate) bf16 dots
run on fp32 copies of the same bf16 values and P is rounded by `round_to` (DOT_F32); compiled
kernels never take that branch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from slimserve.kernels._launch import AotVariant, check, check_tensor, next_pow2, num_sms
from slimserve.kernels._rounding import round_to
from slimserve.kernels.kv_cache import (
    FP8,
    cache_quant,
    cache_row,
    cache_view,
    load_kv_codes,
    load_kv_tile,
    scale_tensor,
)

_LOG2E = 1.4426950408889634
_FP8_UNSCALE = 256.0  # fp8_e4m3_decode_scaled returns value * 2^-8
_Q_DTYPES = (torch.float16, torch.bfloat16)
_TL = {torch.float16: "fp16", torch.bfloat16: "bf16", FP8: "u8", torch.uint8: "u8"}
SPLIT_TILE = 16  # partials the reduce kernel combines per step


@dataclass(frozen=True)
class AttentionConfig:
    """Tiles and launch options. block_m: prefill rows (query tokens x group heads); block_n: KV
    tokens per step; partition: decode tokens per split (multiple of block_n); split: force the
    split-K decode on or off (None: the launcher's heuristic)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    partition: int = 512
    split: bool | None = None


# GPU defaults by (path, head_dim). Decode is bandwidth-bound: 64-token K/V tiles of 128-wide
# heads are 16 KiB each in fp16. Prefill is the flash-attention shape: 128 rows x 64 keys.
CONFIGS = {
    ("decode", 64): AttentionConfig(block_n=128, num_warps=4, num_stages=2),
    ("decode", 128): AttentionConfig(block_n=64, num_warps=4, num_stages=2),
    ("prefill", 64): AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=2),
    ("prefill", 128): AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
}
# Split the decode context when (sequences x KV heads) programs fill less than this many waves
# of the GPU and the longest context spans more than one partition.
SPLIT_MAX_WAVES = 4


def default_config(path: str, head_dim: int) -> AttentionConfig:
    return CONFIGS[(path, 128 if head_dim > 64 else 64)]


def _dot_f32(query: torch.Tensor) -> bool:
    """bf16 dots on fp32 copies, under the interpreter only (see the module docstring)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1" and query.dtype == torch.bfloat16


@triton.jit
def _attend(
    q,
    k,
    v,
    s_mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    P_DTYPE: tl.constexpr,
    DOT_F32: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One online-softmax step of q [M, D] over a KV tile k, v [N, D]; scores in log2 units."""
    if DOT_F32:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    else:
        k = k.to(q.dtype)
        v = v.to(q.dtype)
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_F32:
        p = round_to(p, P_DTYPE)
    else:
        p = p.to(P_DTYPE)
    acc = tl.dot(p, v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _attend_codes(
    q,
    qsum,
    kx,
    ks,
    kz,
    vx,
    vs,
    vz,
    s_mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    P_DTYPE: tl.constexpr,
    DOT_F32: tl.constexpr,
    MASKED: tl.constexpr,
):
    """`_attend` over an int8 / int4 tile: codes kx, vx [N, D] (int32) with their tokens'
    scales and zeros [N] (fp32); qsum [M] = sum of q's row. acc is kept at 2^8 x its value."""
    if DOT_F32:
        kc = kx.to(tl.float32)
        vc = vx.to(tl.float32)
    else:
        kc = kx.to(q.dtype)  # codes <= 255: exact in fp16 and bf16
        vc = vx.to(q.dtype)
    s = (tl.dot(q, tl.trans(kc)) * ks[None, :] + qsum[:, None] * kz[None, :]) * qk_scale
    if MASKED:
        s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pz = tl.sum(p * vz[None, :], 1) * 256.0
    ps = p * (vs * 256.0)[None, :]
    if DOT_F32:
        ps = round_to(ps, P_DTYPE)
    else:
        ps = ps.to(P_DTYPE)
    acc = tl.dot(ps, vc, acc * alpha[:, None]) + pz[:, None]
    return m_new, l_i, acc


@triton.jit
def _attend_tile(
    q,
    qsum,
    kc_ptr,
    vc_ptr,
    bt_row,
    toks,
    tok_ok,
    offs_d,
    stride_kb,
    stride_ko,
    k_off,
    stride_vb,
    stride_vo,
    v_off,
    s_mask,
    m_i,
    l_i,
    acc,
    qk_scale,
    P_DTYPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    IS_FP8: tl.constexpr,
    QUANT: tl.constexpr,
    DOT_F32: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Load one KV tile of tokens `toks` (any cache kind) and take its online-softmax step."""
    if QUANT != 0:
        kx, ks, kz = load_kv_codes(
            kc_ptr,
            bt_row,
            toks,
            tok_ok,
            offs_d,
            stride_kb,
            stride_ko,
            k_off,
            BLOCK_SIZE,
            HEAD_DIM,
            QUANT,
            MASKED,
        )
        vx, vs, vz = load_kv_codes(
            vc_ptr,
            bt_row,
            toks,
            tok_ok,
            offs_d,
            stride_vb,
            stride_vo,
            v_off,
            BLOCK_SIZE,
            HEAD_DIM,
            QUANT,
            MASKED,
        )
        return _attend_codes(
            q,
            qsum,
            kx,
            ks,
            kz,
            vx,
            vs,
            vz,
            s_mask,
            m_i,
            l_i,
            acc,
            qk_scale,
            P_DTYPE,
            DOT_F32,
            MASKED,
        )
    else:
        k = load_kv_tile(
            kc_ptr,
            bt_row,
            toks,
            tok_ok,
            offs_d,
            stride_kb,
            stride_ko,
            k_off,
            BLOCK_SIZE,
            IS_FP8,
            MASKED,
        )
        v = load_kv_tile(
            vc_ptr,
            bt_row,
            toks,
            tok_ok,
            offs_d,
            stride_vb,
            stride_vo,
            v_off,
            BLOCK_SIZE,
            IS_FP8,
            MASKED,
        )
        return _attend(q, k, v, s_mask, m_i, l_i, acc, qk_scale, P_DTYPE, DOT_F32, MASKED)


# ints that change from step to step are not specialized on (divisibility by 16, == 1): one
# compiled variant per config instead of several, compiled by the first requests
@triton.jit(do_not_specialize=["num_splits", "stride_bt"])
def _decode_kernel(
    out_ptr,  # [B, H, D] query dtype (unused when SPLIT)
    part_ptr,
    pm_ptr,
    pl_ptr,  # SPLIT: [B, H, S, D], [B, H, S], [B, H, S] fp32 partials
    q_ptr,
    kc_ptr,
    vc_ptr,  # [B, H, D]; caches [num_blocks, block_size, Hkv, D]
    bt_ptr,
    ctx_ptr,
    ks_ptr,
    vs_ptr,  # [B, max_blocks] i32, [B] i32, [1] fp32, [1] fp32
    qk_scale,
    G,
    num_splits,  # softmax scale * log2(e) (* 2^8 for fp8); heads per KV head
    stride_qb,
    stride_qh,
    stride_bt,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr = 0,  # 8 / 4: int8 / int4 row caches (kernels/kv_cache.py)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b)
    start = 0
    end = ctx
    if SPLIT:
        start = tl.program_id(2) * PARTITION
        end = tl.minimum(ctx, start + PARTITION)
        if start >= end:
            return
    rows = tl.arange(0, BLOCK_G)
    heads = kvh * G + rows
    row_ok = rows < G
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    p_dtype = q_ptr.dtype.element_ty  # fp16/bf16 KV has the query's dtype
    if DOT_F32:
        q = q.to(tl.float32)
    if IS_FP8:
        qk_scale = qk_scale * tl.load(ks_ptr)
    qsum = tl.sum(q.to(tl.float32), 1)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        toks = n0 + tl.arange(0, BLOCK_N)
        ok = toks < end
        m_i, l_i, acc = _attend_tile(
            q,
            qsum,
            kc_ptr,
            vc_ptr,
            bt_row,
            toks,
            ok,
            offs_d,
            stride_kb,
            stride_ko,
            kvh * stride_kh,
            stride_vb,
            stride_vo,
            kvh * stride_vh,
            ok[None, :],
            m_i,
            l_i,
            acc,
            qk_scale,
            p_dtype,
            HEAD_DIM,
            BLOCK_SIZE,
            IS_FP8,
            QUANT,
            DOT_F32,
            True,
        )
    if IS_FP8:
        acc = acc * (tl.load(vs_ptr) * 256.0)
    if QUANT != 0:
        acc = acc * (1.0 / 256.0)
    if SPLIT:
        part = (b * tl.num_programs(1) * G + heads).to(tl.int64) * num_splits + tl.program_id(2)
        tl.store(part_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(pm_ptr + part, m_i, mask=row_ok)
        tl.store(pl_ptr + part, l_i, mask=row_ok)
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # context 0 (a padding row) -> zeros
        dt = out_ptr.dtype.element_ty
        o_off = (b * tl.num_programs(1) * G + heads).to(tl.int64) * HEAD_DIM
        tl.store(
            out_ptr + o_off[:, None] + offs_d[None, :],
            round_to(out, dt).to(dt),
            mask=row_ok[:, None],
        )


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    out_ptr,
    part_ptr,
    pm_ptr,
    pl_ptr,
    ctx_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    PARTITION: tl.constexpr,
    SPLIT_TILE: tl.constexpr,
):
    """out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the used partitions."""
    b = tl.program_id(0)
    row = (b * tl.num_programs(1) + tl.program_id(1)).to(tl.int64)  # b * H + h
    used = tl.minimum(tl.cdiv(tl.load(ctx_ptr + b), PARTITION), num_splits)
    offs_d = tl.arange(0, HEAD_DIM)
    m_run = tl.max(tl.full([SPLIT_TILE], float("-inf"), tl.float32), 0)
    l_run = tl.sum(tl.zeros([SPLIT_TILE], tl.float32), 0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for s0 in range(0, used, SPLIT_TILE):
        s = s0 + tl.arange(0, SPLIT_TILE)
        ok = s < used
        m_s = tl.load(pm_ptr + row * num_splits + s, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        w = tl.where(ok, tl.math.exp2(m_s - m_new), 0.0)
        l_s = tl.load(pl_ptr + row * num_splits + s, mask=ok, other=0.0)
        a_s = tl.load(
            part_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        alpha = tl.math.exp2(m_run - m_new)
        l_run = l_run * alpha + tl.sum(w * l_s, 0)
        acc = acc * alpha + tl.sum(w[:, None] * a_s, 0)
        m_run = m_new
    out = acc / tl.where(l_run > 0, l_run, 1.0)
    dt = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * HEAD_DIM + offs_d, round_to(out, dt).to(dt))


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(
    out_ptr,
    q_ptr,  # [T, H, D] (out contiguous)
    kc_ptr,
    vc_ptr,
    bt_ptr,
    cu_ptr,
    ctx_ptr,
    ks_ptr,
    vs_ptr,  # cu_seqlens_q int32 [B + 1]
    qk_scale,
    G,
    block_q,  # block_q = BLOCK_M // G query tokens per program
    stride_qt,
    stride_qh,
    stride_bt,
    stride_kb,
    stride_ko,
    stride_kh,
    stride_vb,
    stride_vo,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_FP8: tl.constexpr,
    DOT_F32: tl.constexpr,
    QUANT: tl.constexpr = 0,  # 8 / 4: int8 / int4 row caches (kernels/kv_cache.py)
):
    # First query of this tile within its sequence; the last tiles (the most KV to read under
    # the causal mask) are launched first, so the long programs do not form the tail.
    tile0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * block_q
    kvh = tl.program_id(1)
    b = tl.program_id(2)
    q_first = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_first
    if tile0 >= q_len:
        return
    ctx = tl.load(ctx_ptr + b)
    pos0 = ctx - q_len + tile0  # cache position of the tile's first query
    rows = tl.arange(0, BLOCK_M)
    qi = rows // G  # row = (query token qi, group head rows % G)
    row_ok = (qi < block_q) & (tile0 + qi < q_len)
    heads = kvh * G + rows % G
    toks = (q_first + tile0 + qi).to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + (toks * stride_qt + heads * stride_qh)[:, None] + offs_d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )
    p_dtype = q_ptr.dtype.element_ty
    if DOT_F32:
        q = q.to(tl.float32)
    if IS_FP8:
        qk_scale = qk_scale * tl.load(ks_ptr)
    qsum = tl.sum(q.to(tl.float32), 1)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    pos = pos0 + qi  # [BLOCK_M] each row's position; it sees tokens <= pos
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    kh = kvh * stride_kh
    vh = kvh * stride_vh
    # Tokens before pos0 are visible to every row: whole tiles there need no mask.
    full_end = (pos0 // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        m_i, l_i, acc = _attend_tile(
            q,
            qsum,
            kc_ptr,
            vc_ptr,
            bt_row,
            t,
            t >= 0,
            offs_d,
            stride_kb,
            stride_ko,
            kh,
            stride_vb,
            stride_vo,
            vh,
            t[None, :] >= 0,
            m_i,
            l_i,
            acc,
            qk_scale,
            p_dtype,
            HEAD_DIM,
            BLOCK_SIZE,
            IS_FP8,
            QUANT,
            DOT_F32,
            False,
        )
    # Diagonal tiles, up to the last row's position; tiles past it are never loaded.
    kv_end = tl.minimum(ctx, pos0 + block_q)
    for n0 in range(full_end, kv_end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        ok = t < kv_end
        causal = (t[None, :] <= pos[:, None]) & ok[None, :]
        m_i, l_i, acc = _attend_tile(
            q,
            qsum,
            kc_ptr,
            vc_ptr,
            bt_row,
            t,
            ok,
            offs_d,
            stride_kb,
            stride_ko,
            kh,
            stride_vb,
            stride_vo,
            vh,
            causal,
            m_i,
            l_i,
            acc,
            qk_scale,
            p_dtype,
            HEAD_DIM,
            BLOCK_SIZE,
            IS_FP8,
            QUANT,
            DOT_F32,
            True,
        )
    if IS_FP8:
        acc = acc * (tl.load(vs_ptr) * 256.0)
    if QUANT != 0:
        acc = acc * (1.0 / 256.0)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    dt = out_ptr.dtype.element_ty
    o_off = (toks * tl.num_programs(1) * G + heads) * HEAD_DIM  # out is contiguous [T, H, D]
    tl.store(
        out_ptr + o_off[:, None] + offs_d[None, :], round_to(out, dt).to(dt), mask=row_ok[:, None]
    )


def _prepare(
    query,
    key_cache,
    value_cache,
    block_tables,
    context_lens,
    n_seqs,
    scale,
    k_scale,
    v_scale,
    config,
    path,
) -> SimpleNamespace:
    """Check the shared arguments; return what both launchers pass to their kernels."""
    check_tensor("query", query, dtypes=_Q_DTYPES, ndim=3, last_contiguous=True)
    dev, (_, h, d) = query.device, query.shape
    kc, vc = cache_view("key_cache", key_cache), cache_view("value_cache", value_cache)
    quant = cache_quant("key_cache", key_cache, d)
    check_tensor(
        "key_cache", key_cache, shape=(None, None, None, cache_row(key_cache, d, quant)), device=dev
    )
    hkv = key_cache.shape[2]
    check_tensor(
        "value_cache",
        value_cache,
        dtypes=(key_cache.dtype,),
        shape=tuple(key_cache.shape),
        device=dev,
    )
    check(
        key_cache.dtype in (FP8, query.dtype, torch.uint8),
        lambda: (
            f"key_cache has dtype {key_cache.dtype}; expected the query's dtype "
            f"{query.dtype}, float8_e4m3fn or uint8 (int8 / int4 rows)"
        ),
    )
    check(
        hkv > 0 and h % hkv == 0,
        lambda: f"query has {h} heads; expected a multiple of key_cache's {hkv} KV heads",
    )
    check(
        d in (16, 32, 64, 128), lambda: f"head_dim {d} is not supported; expected 16, 32, 64 or 128"
    )
    check_tensor("block_tables", block_tables, dtypes=(torch.int32,), ndim=2, device=dev)
    check(
        block_tables.shape[0] == n_seqs,
        lambda: (
            f"block_tables has {block_tables.shape[0]} rows; expected one per sequence ({n_seqs})"
        ),
    )
    check_tensor("context_lens", context_lens, dtypes=(torch.int32,), shape=(n_seqs,), device=dev)
    cfg = config or default_config(path, d)
    check(
        isinstance(cfg, AttentionConfig), lambda: f"config must be an AttentionConfig, got {cfg!r}"
    )
    check(
        cfg.block_n >= 16 and cfg.block_n == next_pow2(cfg.block_n),
        lambda: f"config.block_n={cfg.block_n} must be a power of two >= 16",
    )
    fp8 = key_cache.dtype == FP8
    return SimpleNamespace(
        kc=kc,
        vc=vc,
        ks=scale_tensor("k_scale", k_scale, dev),
        vs=scale_tensor("v_scale", v_scale, dev),
        cfg=cfg,
        fp8=fp8,
        g=h // hkv,
        hkv=hkv,
        h=h,
        d=d,
        bs=key_cache.shape[1],
        out=torch.empty(query.shape, dtype=query.dtype, device=dev),  # contiguous [*, H, D]
        qk_scale=float(scale) * _LOG2E * (_FP8_UNSCALE if fp8 else 1.0),
        strides=(
            kc.stride(0),
            kc.stride(1),
            kc.stride(2),
            vc.stride(0),
            vc.stride(1),
            vc.stride(2),
        ),
        consts=dict(
            HEAD_DIM=d,
            BLOCK_SIZE=key_cache.shape[1],
            BLOCK_N=cfg.block_n,
            IS_FP8=fp8,
            QUANT=quant,
            DOT_F32=_dot_f32(query),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        ),
    )


def use_split(
    batch: int, num_kv_heads: int, max_ctx: int, cfg: AttentionConfig, device: torch.device
) -> bool:
    """Split-K decode when the (sequence, KV head) programs fill few waves of the GPU and the
    context spans several partitions; config.split overrides."""
    if cfg.split is not None:
        return cfg.split
    return batch * num_kv_heads < SPLIT_MAX_WAVES * num_sms(device) and max_ctx > cfg.partition


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    *,
    config: AttentionConfig | None = None,
    max_context_len: int | None = None,
) -> torch.Tensor:
    """query [B, H, D] (one token per sequence) over context_lens[b] cached tokens -> [B, H, D].

    max_context_len: host-side bound on context_lens (it must not be smaller) that sizes the
    split grid; default: the block table's capacity, so no device sync (CUDA-graph safe).
    A context of 0 (a padding row) gives zeros.
    """
    b = query.shape[0] if isinstance(query, torch.Tensor) else 0
    p = _prepare(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        b,
        scale,
        k_scale,
        v_scale,
        config,
        "decode",
    )
    cfg, dev = p.cfg, query.device
    check(
        cfg.partition > 0 and cfg.partition % cfg.block_n == 0,
        lambda: f"config.partition={cfg.partition} must be a positive multiple of block_n",
    )
    max_ctx = block_tables.shape[1] * p.bs if max_context_len is None else int(max_context_len)
    if b == 0 or max_ctx <= 0:
        return p.out.zero_()
    split = use_split(b, p.hkv, max_ctx, cfg, dev)
    n_split = triton.cdiv(max_ctx, cfg.partition) if split else 1
    part = torch.empty((b, p.h, n_split, p.d) if split else (1,), dtype=torch.float32, device=dev)
    pml = torch.empty((2, b, p.h, n_split) if split else (2, 1), dtype=torch.float32, device=dev)
    _decode_kernel[(b, p.hkv, n_split)](
        p.out,
        part,
        pml[0],
        pml[1],
        query,
        p.kc,
        p.vc,
        block_tables,
        context_lens,
        p.ks,
        p.vs,
        p.qk_scale,
        p.g,
        n_split,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        *p.strides,
        BLOCK_G=max(16, next_pow2(p.g)),
        PARTITION=cfg.partition,
        SPLIT=split,
        **p.consts,
    )
    if split:
        _reduce_kernel[(b, p.h)](
            p.out,
            part,
            pml[0],
            pml[1],
            context_lens,
            n_split,
            HEAD_DIM=p.d,
            PARTITION=cfg.partition,
            SPLIT_TILE=SPLIT_TILE,
            num_warps=4,
        )
    return p.out


def paged_attention_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    *,
    config: AttentionConfig | None = None,
    max_q_len: int | None = None,
) -> torch.Tensor:
    """Causal attention of query [T, H, D] (sequence b's tokens are cu_seqlens_q[b]:[b+1], their
    K/V already cached) over each sequence's cache -> [T, H, D].

    max_q_len: host-side bound on the per-sequence query count that sizes the grid without a
    device sync (default T); it must not be smaller than the longest sequence's q_len.
    """
    check_tensor("cu_seqlens_q", cu_seqlens_q, dtypes=(torch.int32,), ndim=1)
    n = cu_seqlens_q.shape[0] - 1
    check(n >= 0, "cu_seqlens_q must have B + 1 entries, got 0")
    p = _prepare(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        n,
        scale,
        k_scale,
        v_scale,
        config,
        "prefill",
    )
    check_tensor("cu_seqlens_q", cu_seqlens_q, device=query.device)
    bm = p.cfg.block_m
    check(
        bm >= 16 and bm == next_pow2(bm) and bm >= p.g,
        lambda: (
            f"config.block_m={bm} must be a power of two >= 16 and >= {p.g} (heads per KV head)"
        ),
    )
    max_q = query.shape[0] if max_q_len is None else int(max_q_len)
    check(max_q >= 0, lambda: f"max_q_len={max_q_len} must be >= 0")
    if query.shape[0] == 0 or n == 0 or max_q == 0:
        return p.out
    block_q = bm // p.g
    _prefill_kernel[(triton.cdiv(max_q, block_q), p.hkv, n)](
        p.out,
        query,
        p.kc,
        p.vc,
        block_tables,
        cu_seqlens_q,
        context_lens,
        p.ks,
        p.vs,
        p.qk_scale,
        p.g,
        block_q,
        query.stride(0),
        query.stride(1),
        block_tables.stride(0),
        *p.strides,
        BLOCK_M=bm,
        **p.consts,
    )
    return p.out


# --- AOT variants for the compile gate (tests/kernels/test_aot_compile.py): fp16/bf16 query x
# (same-dtype or fp8) KV x head_dim 64/128 x decode, split decode (+ its reduce) and prefill,
# with the GPU default configs, block size 16 and GQA groups <= 16.


def _signature(kernel, ptrs: dict[str, str], consts: dict) -> dict[str, str]:
    """AOT signature: pointers as given (default fp32), constexprs, qk_scale fp32, ints i32."""
    fn = getattr(kernel, "fn", kernel)
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return {
        n: "constexpr"
        if n in consts
        else ptrs.get(n, "*fp32")
        if n.endswith("_ptr")
        else "fp32"
        if n == "qk_scale"
        else "i32"
        for n in names
    }


def aot_variants() -> list[AotVariant]:
    """Every variant the runtime launches on a GPU by default (see the module docstring)."""
    variants = []
    for qdt in _Q_DTYPES:
        for kvdt, quant in ((qdt, 0), (FP8, 0), (torch.uint8, 8), (torch.uint8, 4)):
            q, kv = _TL[qdt], _TL[kvdt]
            kind = f"int{quant}" if quant else kv
            ptrs = {
                "out_ptr": f"*{q}",
                "q_ptr": f"*{q}",
                "kc_ptr": f"*{kv}",
                "vc_ptr": f"*{kv}",
                "bt_ptr": "*i32",
                "ctx_ptr": "*i32",
                "cu_ptr": "*i32",
            }
            for d in (64, 128):
                base = {
                    "HEAD_DIM": d,
                    "BLOCK_SIZE": 16,
                    "IS_FP8": kvdt == FP8,
                    "DOT_F32": False,
                    "QUANT": quant,
                }
                dc, pc = default_config("decode", d), default_config("prefill", d)
                for split in (False, True):
                    consts = dict(
                        base, BLOCK_G=16, BLOCK_N=dc.block_n, PARTITION=dc.partition, SPLIT=split
                    )
                    variants.append(
                        AotVariant(
                            _decode_kernel,
                            _signature(_decode_kernel, ptrs, consts),
                            consts,
                            {"num_warps": dc.num_warps, "num_stages": dc.num_stages},
                            name=f"decode_{q}_{kind}_d{d}{'_split' if split else ''}",
                        )
                    )
                consts = dict(base, BLOCK_M=pc.block_m, BLOCK_N=pc.block_n)
                variants.append(
                    AotVariant(
                        _prefill_kernel,
                        _signature(_prefill_kernel, ptrs, consts),
                        consts,
                        {"num_warps": pc.num_warps, "num_stages": pc.num_stages},
                        name=f"prefill_{q}_{kind}_d{d}",
                    )
                )
                if kvdt == qdt:
                    consts = {"HEAD_DIM": d, "PARTITION": dc.partition, "SPLIT_TILE": SPLIT_TILE}
                    variants.append(
                        AotVariant(
                            _reduce_kernel,
                            _signature(_reduce_kernel, ptrs, consts),
                            consts,
                            {"num_warps": 4},
                            name=f"reduce_{q}_d{d}",
                        )
                    )
    return variants
