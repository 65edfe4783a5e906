"""Pure-torch twins of the KV-cache and attention kernels: fp8 KV codes, the paged-cache write,
RoPE, and paged attention (planned once per step). The CPU path and the test oracle of
kernels/kv_cache.py, kernels/rope_kv_cache.py and kernels/paged_attention.py; the GEMM, norm and
activation twins are in kernels/reference.py.

Caches are [num_blocks, block_size, kv_heads, head_dim]; a sequence's tokens live in the blocks
its block table lists, in order. fp8 caches hold e4m3 codes of value / scale. int8 / int4 caches
are uint8 [num_blocks, block_size, kv_heads, row_bytes] with each row's codes, scale and zero
(kernels/kv_quant.py); the scales are per token and head, so k_scale / v_scale do not apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from slimserve.kernels import kv_quant

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
    an int8 / int4 cache (uint8 rows, kernels/kv_quant.py) each row's codes and own scales; any
    other cache dtype stores the values cast as they are.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    bits = kv_quant.cache_bits(key_cache, key.shape[-1])
    for src, cache, scale in ((key[keep], key_cache, k_scale), (value[keep], value_cache, v_scale)):
        flat = cache.view(-1, *cache.shape[2:])  # [num_blocks * block_size, Hkv, D or row bytes]
        if bits:
            flat[slots] = kv_quant.quantize_rows(src, bits)
        elif cache.dtype == torch.float8_e4m3fn:
            flat[slots] = quantize_fp8(src, scale)
        else:
            flat[slots] = src.to(cache.dtype)


def rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
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


_DECODE_BUCKET = 8  # decode rows per padded attention batch on the torch path


@dataclass(frozen=True)
class _DecodeBucket:
    """Up to _DECODE_BUCKET one-token rows of similar context length, attended as one batch."""

    rows: torch.Tensor  # int64 [n]: rows of query/out
    blocks: torch.Tensor  # int64 [n * nblk]: the first nblk blocks of each row's table
    length: int  # nblk * block_size: the padded context of the bucket
    mask: torch.Tensor  # fp32 [n, 1, 1, length]: 0 for a key in the row's context, -inf past it


@dataclass(frozen=True)
class _PrefillSeq:
    """One sequence with several new tokens: its own causal attention, unpadded."""

    start: int  # its first row in query/out
    q_len: int
    ctx: int  # cached tokens after this step's writes (prefix + q_len)
    blocks: torch.Tensor  # int64 [ceil(ctx / block_size)]
    mask: torch.Tensor | None  # bool [q_len, ctx] when a prefix precedes the chunk; None: causal


@dataclass(frozen=True)
class AttentionPlan:
    """The index work of one step's torch paged attention, built once by `plan_attention` and
    shared by every layer (only the caches and the query change from layer to layer)."""

    decode: tuple[_DecodeBucket, ...]
    prefill: tuple[_PrefillSeq, ...]
    window: int | None = None  # sliding window the masks apply (`plan_attention`); None: full


def plan_attention(
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    window: int | None = None,
) -> AttentionPlan:
    """Plan `paged_attention` for a batch (the arguments of `paged_attention_prefill`).

    window: a sliding window of that many positions: the query at position p sees the keys at
    positions p - window + 1 .. p (transformers' `sliding_window_overlay`, kv > q - window, in
    transformers/masking_utils.py); None: every earlier position.

    One-token rows are sorted by context length and cut into buckets of _DECODE_BUCKET, so a
    row is padded only to the longest context of its bucket (and the whole batch is not padded
    to its longest context). Each sequence with several new tokens is attended alone, unpadded:
    a step holds few of them, and padding prompt chunks to the longest one costs more than the
    loop (5x on log-normal prompt lengths).
    """
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    dev = block_tables.device
    single, several = [], []
    for b, _c in enumerate(ctx):
        n = cu[b + 1] - cu[b]
        if n == 1:
            single.append(b)
        elif n > 1:
            several.append(b)
    buckets = []
    single.sort(key=ctx.__getitem__)
    for i in range(0, len(single), _DECODE_BUCKET):
        part = single[i : i + _DECODE_BUCKET]
        nblk = -(-ctx[part[-1]] // block_size)  # sorted: the last row has the longest context
        seq = torch.tensor(part, dtype=torch.int64, device=dev)
        rows = torch.tensor([cu[b] for b in part], dtype=torch.int64, device=dev)
        lens = torch.tensor([ctx[b] for b in part], device=dev)
        kpos = torch.arange(nblk * block_size, device=dev)
        past = kpos >= lens.unsqueeze(1)
        if window is not None:  # the one query sits at position len - 1
            past |= kpos <= lens.unsqueeze(1) - 1 - window
        mask = torch.zeros(past.shape, device=dev).masked_fill_(past, float("-inf"))
        buckets.append(
            _DecodeBucket(
                rows,
                block_tables[seq, :nblk].long().flatten(),
                nblk * block_size,
                mask.view(len(part), 1, 1, -1),
            )
        )
    seqs = []
    for b in several:
        n, c = cu[b + 1] - cu[b], ctx[b]
        mask = None
        if c > n or (window is not None and n > window):
            # query i sits at position c - n + i and sees keys up to it (and, under a window,
            # none window or more positions before it)
            kpos = torch.arange(c, device=dev)
            qpos = (c - n + torch.arange(n, device=dev)).unsqueeze(1)
            mask = kpos <= qpos
            if window is not None:
                mask &= kpos > qpos - window
        seqs.append(_PrefillSeq(cu[b], n, c, block_tables[b, : -(-c // block_size)].long(), mask))
    return AttentionPlan(tuple(buckets), tuple(seqs), window)


def _gather_kv(
    cache: torch.Tensor,
    blocks: torch.Tensor,
    rows: int,
    length: int,
    scale: float | torch.Tensor,
    head_dim: int,
) -> torch.Tensor:
    """fp32 [rows, Hkv, length, D] (a transposed view): the first `length` cached tokens of
    `rows` block lists laid end to end (fp8 dequantized with its scale, int8 / int4 with each
    row's own)."""
    kv = cache.index_select(0, blocks)  # [rows * nblk, bs, Hkv, D]; faster than cache[blocks]
    kv = kv.view(rows, -1, *cache.shape[2:])[:, :length]
    bits = kv_quant.cache_bits(cache, head_dim)
    if bits:
        kv = kv_quant.dequantize_rows(kv, head_dim, bits)
    else:
        kv = kv.float()
    if cache.dtype == torch.float8_e4m3fn:
        kv = kv * float(scale)
    return kv.transpose(1, 2)


def _attend(q, k, v, mask, causal: bool, scale: float, gqa: bool, softcap: float | None):
    """SDPA of fp32 [n, H, q, D] over [n, Hkv, k, D]; with `softcap`, the scaled scores are
    capped to softcap * tanh(s / softcap) before the mask and softmax, as transformers' Gemma 2
    eager attention does (transformers/models/gemma2/modeling_gemma2.py)."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa
        )
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / softcap) * softcap
    if causal:
        n, m = s.shape[-2:]
        mask = torch.ones(n, m, dtype=torch.bool, device=s.device).tril(m - n)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.matmul(torch.softmax(s, dim=-1), v)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    plan: AttentionPlan,
    scale: float,
    k_scale: float | torch.Tensor = 1.0,
    v_scale: float | torch.Tensor = 1.0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`paged_attention_prefill` of a planned batch (`plan_attention`): the CPU serving path.

    key/value [T, Hkv, D]: this step's keys and values as just written to the cache (optional).
    When the cache holds them exactly (their own dtype, or fp32; fp8, int8 and int4 do not), a
    chunk without a prefix attends over them directly instead of gathering its blocks back.
    softcap: scores capped to softcap * tanh(score / softcap) (Gemma 2); the sliding window,
    if any, is the plan's.
    """
    out = torch.empty_like(query)
    gqa = query.shape[1] != key_cache.shape[2]
    d = query.shape[-1]
    fresh = key is not None and value is not None and key_cache.dtype in (key.dtype, torch.float32)
    for b in plan.decode:
        n = b.rows.shape[0]
        q = query.index_select(0, b.rows).float().unsqueeze(2)  # [n, H, 1, D]
        k = _gather_kv(key_cache, b.blocks, n, b.length, k_scale, d)
        v = _gather_kv(value_cache, b.blocks, n, b.length, v_scale, d)
        o = _attend(q, k, v, b.mask, False, scale, gqa, softcap)
        out.index_copy_(0, b.rows, o.squeeze(2).to(query.dtype))
    for s in plan.prefill:
        rows = slice(s.start, s.start + s.q_len)
        q = query[rows].float().transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if fresh and s.mask is None:
            k = key[rows].float().transpose(0, 1).unsqueeze(0)
            v = value[rows].float().transpose(0, 1).unsqueeze(0)
        else:
            k = _gather_kv(key_cache, s.blocks, 1, s.ctx, k_scale, d)
            v = _gather_kv(value_cache, s.blocks, 1, s.ctx, v_scale, d)
        o = _attend(q, k, v, s.mask, s.mask is None, scale, gqa, softcap)
        out[rows] = o[0].transpose(0, 1).to(query.dtype)
    return out


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
    query's dtype. The CPU serving path runs the same computation as `plan_attention` once per
    step plus `paged_attention` per layer; tests/kernels check it against a per-sequence loop.
    """
    plan = plan_attention(cu_seqlens_q, context_lens, block_tables, key_cache.shape[1])
    return paged_attention(query, key_cache, value_cache, plan, scale, k_scale, v_scale)


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
    return paged_attention_prefill(
        query, key_cache, value_cache, block_tables, cu, context_lens, scale, k_scale, v_scale
    )
