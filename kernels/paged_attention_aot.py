"""AOT variants of the paged-attention kernels (kernels/paged_attention.py) for the compile gate:
fp16/bf16 query x (same-dtype or fp8) KV x head_dim 64/128 x decode, split decode (+ its reduce)
and prefill, with the GPU default configs, block size 16 and GQA groups <= 16."""

from __future__ import annotations

from slimserve.kernels._launch import AotVariant
from slimserve.kernels.kv_cache import FP8
from slimserve.kernels.paged_attention import (
    _Q_DTYPES, _TL, SPLIT_TILE, _decode_kernel, _prefill_kernel, _reduce_kernel, default_config)


def _signature(kernel, ptrs: dict[str, str], consts: dict) -> dict[str, str]:
    """AOT signature: pointers as given (default fp32), constexprs, qk_scale fp32, ints i32."""
    fn = getattr(kernel, "fn", kernel)
    names = fn.__code__.co_varnames[: fn.__code__.co_argcount]
    return {n: "constexpr" if n in consts else ptrs.get(n, "*fp32") if n.endswith("_ptr")
            else "fp32" if n == "qk_scale" else "i32" for n in names}


def aot_variants() -> list[AotVariant]:
    """Every variant the runtime launches on a GPU by default (see the module docstring)."""
    variants = []
    for qdt in _Q_DTYPES:
        for kvdt in (qdt, FP8):
            q, kv = _TL[qdt], _TL[kvdt]
            ptrs = {"out_ptr": f"*{q}", "q_ptr": f"*{q}", "kc_ptr": f"*{kv}",
                    "vc_ptr": f"*{kv}", "bt_ptr": "*i32", "ctx_ptr": "*i32", "cu_ptr": "*i32"}
            for d in (64, 128):
                base = {"HEAD_DIM": d, "BLOCK_SIZE": 16, "IS_FP8": kvdt == FP8, "DOT_F32": False}
                dc, pc = default_config("decode", d), default_config("prefill", d)
                for split in (False, True):
                    consts = dict(base, BLOCK_G=16, BLOCK_N=dc.block_n, PARTITION=dc.partition,
                                  SPLIT=split)
                    variants.append(AotVariant(
                        _decode_kernel, _signature(_decode_kernel, ptrs, consts), consts,
                        {"num_warps": dc.num_warps, "num_stages": dc.num_stages},
                        name=f"decode_{q}_{kv}_d{d}{'_split' if split else ''}"))
                consts = dict(base, BLOCK_M=pc.block_m, BLOCK_N=pc.block_n)
                variants.append(AotVariant(
                    _prefill_kernel, _signature(_prefill_kernel, ptrs, consts), consts,
                    {"num_warps": pc.num_warps, "num_stages": pc.num_stages},
                    name=f"prefill_{q}_{kv}_d{d}"))
                if kvdt == qdt:
                    consts = {"HEAD_DIM": d, "PARTITION": dc.partition, "SPLIT_TILE": SPLIT_TILE}
                    variants.append(AotVariant(
                        _reduce_kernel, _signature(_reduce_kernel, ptrs, consts), consts,
                        {"num_warps": 4}, name=f"reduce_{q}_d{d}"))
    return variants
