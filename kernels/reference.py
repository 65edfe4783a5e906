"""Pure-torch twins of the kernels: the CPU path and the test oracle.

Everything follows compressed-tensors' on-disk layout (docs/architecture.md, "The safetensors"):
codes are stored offset-binary, packed 32/b per int32 word along K with the lowest index in the
low bits; asymmetric zero points are packed the same way along N. Dequantization is done in fp32,
W[n, k] = (q[n, k] - zp[n, g(k)]) * scale[n, g(k)], and the caller casts once; since
|q - zp| < 2^8 and the scale has at most 11 significant bits, the fp32 product is exact and
the single cast matches the fake-quantized weight bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_INT8_ACT_DIV = 127.5  # (qmax - qmin) / 2 for int8: CT's symmetric scale divisor
_EPS = torch.finfo(torch.float32).eps  # smallest scale, as in compressed-tensors


def _unpack(packed: torch.Tensor, num_bits: int, size: int) -> torch.Tensor:
    """int32 signed codes [R, size] from int32 words [R, W] packed along the last dim."""
    if 32 % num_bits:
        return _unpack_dense(packed, num_bits, size)
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * num_bits
    fields = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)  # arithmetic shift, masked
    return fields.reshape(packed.shape[0], -1)[:, :size] - (1 << (num_bits - 1))


def _unpack_dense(packed: torch.Tensor, num_bits: int, size: int) -> torch.Tensor:
    """Widths that do not divide 32 (3, 5, 6, 7): code i is bits [i*b, (i+1)*b) of the row's
    little-endian word stream and may straddle two words."""
    words = torch.cat([packed.long() & 0xFFFFFFFF, torch.zeros_like(packed[:, :1], dtype=torch.long)], 1)
    start = torch.arange(size, device=packed.device) * num_bits
    w, off = start // 32, start % 32
    fields = ((words[:, w] >> off) | (words[:, w + 1] << (32 - off))) & ((1 << num_bits) - 1)
    return fields.to(torch.int32) - (1 << (num_bits - 1))


def unpack_int4_weight(weight_packed: torch.Tensor, size: int) -> torch.Tensor:
    """int32 [N, size] signed codes in [-8, 7] from int32 [N, ceil(size/8)]."""
    return _unpack(weight_packed, 4, size)


def unpack_int8_weight(weight_packed: torch.Tensor, size: int) -> torch.Tensor:
    """int32 [N, size] signed codes in [-128, 127] from int32 [N, ceil(size/4)]."""
    return _unpack(weight_packed, 8, size)


def unpack_zero_point(weight_zero_point: torch.Tensor, num_bits: int, rows: int) -> torch.Tensor:
    """int32 [N, G] signed zero points from int32 [ceil(N*b/32), G] packed along N."""
    return _unpack(weight_zero_point.t().contiguous(), num_bits, rows).t()


def _group_index(k: int, groups: int, g_idx: torch.Tensor | None, group_size: int | None,
                 device: torch.device) -> torch.Tensor:
    """int64 [K] scale column of each input column."""
    if g_idx is not None:
        return g_idx.long()
    if groups == 1:
        return torch.zeros(k, dtype=torch.long, device=device)
    if not group_size:
        raise ValueError(f"scales have {groups} groups but group_size={group_size}; pass the "
                         "scheme's group_size or a weight_g_idx")
    return torch.arange(k, device=device) // group_size


def dequantize_codes(
    codes: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    group_size: int | None,
) -> torch.Tensor:
    """fp32 [N, K] from signed codes [N, K], scale [N, G] (or [1]), signed zero point [N, G]."""
    k = codes.shape[1]
    scale = weight_scale.float().reshape(weight_scale.shape[0], -1)  # [N, G] or [1, 1]
    gidx = _group_index(k, scale.shape[1], weight_g_idx, group_size, codes.device)
    q = codes.float()
    if weight_zero_point is not None:
        q = q - weight_zero_point.float().reshape(scale.shape)[:, gidx]
    return q * scale[:, gidx]


def dequantize_packed(
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None,
    weight_g_idx: torch.Tensor | None,
    weight_shape: torch.Tensor | tuple[int, int],
    num_bits: int,
    group_size: int | None,
) -> torch.Tensor:
    """fp32 [N, K] weight of a pack-quantized Linear (4 or 8 bits); the caller casts it."""
    n, k = (int(v) for v in weight_shape)
    codes = _unpack(weight_packed, num_bits, k)
    zp = unpack_zero_point(weight_zero_point, num_bits, n) if weight_zero_point is not None else None
    return dequantize_codes(codes, weight_scale, zp, weight_g_idx, group_size)


def linear_w4a16(
    x: torch.Tensor,
    weight_packed: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_shape: torch.Tensor | tuple[int, int],
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    group_size: int | None = None,
    bias: torch.Tensor | None = None,
    num_bits: int = 4,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W from packed codes (wNa16, N=4 or 8)."""
    w = dequantize_packed(weight_packed, weight_scale, weight_zero_point, weight_g_idx,
                          weight_shape, num_bits, group_size)
    return F.linear(x, w.to(x.dtype), bias)


def linear_dequant(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    weight_zero_point: torch.Tensor | None = None,
    weight_g_idx: torch.Tensor | None = None,
    group_size: int | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W from unpacked int8 codes [N, K]."""
    w = dequantize_codes(weight, weight_scale, weight_zero_point, weight_g_idx, group_size)
    return F.linear(x, w.to(x.dtype), bias)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 per token: codes int8 [..., K] and scale [..., 1] in x's dtype.

    scale = absmax / 127.5 (CT's symmetric divisor), rounded to x's dtype before the codes are
    computed; codes = round(clamp(x / scale, -128, 127)).
    """
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.clamp(absmax / _INT8_ACT_DIV, min=_EPS).to(x.dtype)
    q = torch.round(torch.clamp(xf / scale.float(), -128, 127)).to(torch.int8)
    return q, scale


def fake_quantize_per_token_int8(x: torch.Tensor) -> torch.Tensor:
    """x quantized to int8 per token and back, in x's dtype (what a W8A8 kernel sees)."""
    q, scale = quantize_per_token_int8(x)
    return (q.float() * scale.float()).to(x.dtype)


def w8a8_matmul_int32(a_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """Exact int32 [M, N] = a_q int8 [M, K] @ w_q int8 [N, K]^T (fp64 sums are exact: |sum| <
    K * 2^14 < 2^53)."""
    return (a_q.double() @ w_q.double().t()).to(torch.int32)


def w8a8_gemm(
    a_q: torch.Tensor,
    a_scale: torch.Tensor,
    w_q: torch.Tensor,
    w_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[M, N] out_dtype = (int32 acc) * a_scale [M, 1] * w_scale [N, 1]^T (+ bias), fp32 epilogue."""
    acc = w8a8_matmul_int32(a_q, w_q).float()
    out = acc * a_scale.float().reshape(-1, 1) * w_scale.float().reshape(1, -1)
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


def linear_w8a8(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N]: dynamic per-token int8 activations times int8 [N, K] weights."""
    lead = x.shape[:-1]
    q, s = quantize_per_token_int8(x.reshape(-1, x.shape[-1]))
    return w8a8_gemm(q, s, weight, weight_scale, bias, x.dtype).reshape(*lead, -1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm exactly as transformers computes it: normalize in fp32, round to x's dtype,
    then multiply by the weight in x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(x.dtype) * normed.to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum is rounded to x's dtype first, as the
    unfused `residual = residual + hidden` of a transformers decoder layer does."""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up with gate = x[..., :I], up = x[..., I:]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of x / scale, saturated to +-448 and rounded to nearest even."""
    return (x.float() / float(scale)).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """Store key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] in place.

    slot_mapping int64 [T]: slot = block * block_size + offset; a negative slot skips the token.
    An fp8 cache stores key / k_scale (value / v_scale) saturated and rounded to nearest even;
    any other cache dtype stores the values cast as they are.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    for src, cache, scale in ((key[keep], key_cache, k_scale), (value[keep], value_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, Hkv, D]
        if cache.dtype == torch.float8_e4m3fn:
            flat[slots] = quantize_fp8(src, scale)
        else:
            flat[slots] = src.to(cache.dtype)


def rope_tables(positions: torch.Tensor,
                inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [T, D/2] fp32 of positions [T] x inv_freq [D/2] (fp32): computed once per
    step and shared by every layer's `rope_and_write_kv`. transformers' tables are these
    concatenated with themselves (cos(cat(f, f)) = cat(cos f, cos f))."""
    freqs = positions.unsqueeze(1) * inv_freq.unsqueeze(0)  # int64 * fp32 promotes to fp32
    return freqs.cos(), freqs.sin()


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """transformers' rotate_half RoPE of x [T, heads, D] in place, in fp32, rounded once to x's
    dtype: out1 = x1 c - x2 s, out2 = x2 c + x1 s with cos/sin [T, D/2] (bit for bit
    `x * cat(c, c) + cat(-x2, x1) * cat(s, s)`: negation is exact)."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    out1 = x1 * c - x2 * s
    out2 = x2 * c + x1 * s
    x[..., :half].copy_(out1)  # the fp32 -> dtype cast of copy_ rounds to nearest even
    x[..., half:].copy_(out2)


def rope_and_write_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> None:
    """RoPE on query [T, H, D] and key [T, Hkv, D] in place (cos/sin [T, D/2] fp32), then the
    rotated key and value written to the paged caches as `write_kv_cache` does (negative slots
    skipped). Twin of kernels/rope_kv_cache.py."""
    rope_inplace(query, cos, sin)
    rope_inplace(key, cos, sin)
    write_kv_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, length: int,
               scale: float | torch.Tensor) -> torch.Tensor:
    """fp32 [B, length, Hkv, D]: the first `length` cached tokens of every sequence's blocks
    (fp8 dequantized with its scale); slots past a sequence's context are masked by the caller."""
    bs = cache.shape[1]
    blocks = block_tables[:, : -(-length // bs)].long()  # [B, nblk]
    kv = cache.index_select(0, blocks.flatten())  # [B * nblk, bs, Hkv, D]; faster than cache[blocks]
    kv = kv.view(blocks.shape[0], -1, *cache.shape[2:])[:, :length].float()  # [B, length, Hkv, D]
    return kv * float(scale) if cache.dtype == torch.float8_e4m3fn else kv


_ATTN_BUCKET = 32  # sequences per padded attention batch on the torch path


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
) -> torch.Tensor:
    """Causal attention of new query tokens over each sequence's cached KV (prefix + new tokens).

    query [T, H, D] holds sequence b's q_len_b = cu_seqlens_q[b+1] - cu_seqlens_q[b] new tokens;
    their K/V are already in the cache, so sequence b has context_lens[b] cached tokens and its
    j-th query sits at position context_lens[b] - q_len_b + j and sees positions <= that.
    GQA: query head h reads KV head h // (H / Hkv). fp32 scores and softmax; out [T, H, D] in
    query's dtype. This is also the CPU serving path: sequences with one new token and those
    with several are computed as two padded batches (so a long prefill chunk does not pad every
    decode to its length), each with one fused SDPA call; tests/kernels check it against a
    per-sequence loop.
    """
    out = torch.empty_like(query)
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    single = q_lens == 1
    ctx = context_lens.long()
    for group in (single, ~single & (q_lens > 0)):
        seqs = group.nonzero().flatten()
        # sorted by context length and cut into buckets, so short contexts are not padded to
        # the longest one (the gather and SDPA cost B x max context per bucket)
        seqs = seqs[ctx[seqs].argsort()]
        for part in seqs.split(_ATTN_BUCKET) if seqs.numel() else ():
            _attend(query, out, key_cache, value_cache, block_tables[part], cu[:-1][part],
                    q_lens[part], ctx[part], scale, k_scale, v_scale)
    return out


def _attend(query, out, key_cache, value_cache, block_tables, starts, q_lens, ctx, scale,
            k_scale, v_scale) -> None:
    """paged_attention_prefill for the sequences given (their rows start at `starts`)."""
    heads, d = query.shape[1:]
    nseq, max_q, max_ctx = q_lens.shape[0], int(q_lens.max()), int(ctx.max())
    dev = query.device
    seq_of = torch.repeat_interleave(torch.arange(nseq, device=dev), q_lens)  # token -> sequence
    j = torch.arange(seq_of.shape[0], device=dev) - (q_lens.cumsum(0) - q_lens)[seq_of]
    rows = starts[seq_of] + j  # rows of `query` / `out`
    q = query.new_zeros((nseq, max_q, heads, d), dtype=torch.float32)
    q[seq_of, j] = query[rows].float()
    k = _gather_kv(key_cache, block_tables, max_ctx, k_scale)  # [B, ctx, Hkv, D]
    v = _gather_kv(value_cache, block_tables, max_ctx, v_scale)
    qpos = (ctx - q_lens).unsqueeze(1) + torch.arange(max_q, device=dev)  # [B, max_q]
    kpos = torch.arange(max_ctx, device=dev).view(1, 1, -1)
    allowed = (kpos <= qpos.unsqueeze(-1)) & (kpos < ctx.view(-1, 1, 1))  # [B, max_q, ctx]
    allowed[..., 0] = True  # padded query rows see one key (their output is dropped): no NaN
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=allowed.unsqueeze(1),
        scale=scale, enable_gqa=heads != k.shape[2])  # [B, H, max_q, D]
    out[rows] = o.transpose(1, 2)[seq_of, j].to(query.dtype)


def paged_attention_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """One new query token per sequence: query [B, H, D] over context_lens[b] cached tokens
    (including its own) -> [B, H, D] in query's dtype."""
    cu = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
    return paged_attention_prefill(query, key_cache, value_cache, block_tables, cu, context_lens,
                                   scale, k_scale, v_scale)
