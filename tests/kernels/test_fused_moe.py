"""kernels/fused_moe.py vs its twins, and the runtime's MoE block on the fused route.

On CPU the kernels run through the Triton interpreter (tests/conftest.py sets it) at small
shapes (T = 1, 5, 33; E = 4, 8; top-1 and top-2; H = 64; I = 32, 64); on a CUDA machine the
same tests run the compiled kernels.

Tolerances:
  * one grouped GEMM (`moe_gemm` vs `moe_gemm_torch`), dense and W4A16: both multiply the same
    rounded operands (the W4A16 tile is dequantized exactly, then rounded once to x's dtype), so
    they differ by the order of the fp32 sums (<= 2 K 2^-24 sum |x||w| |rw|, kernel and twin)
    and then by at most one ulp of the output where the two fp32 values round apart;
  * W8A8: the int32 accumulators are exact and the fp32 epilogue is the same operations in the
    same order (no FMA contraction): at most one ulp, bit-equal in practice;
  * the whole FFN (`fused_moe` vs `fused_moe_torch`): the gate/up output may round apart by an
    ulp, silu-and-mul by two (tests/kernels/test_activation.py), an int8 code may flip where an
    activation sits on a rounding boundary; the error is held to 2^-5 (16-bit) or 2^-14 (fp32)
    of `scale` = sum_j |rw_j| (|act_j| @ |W_down|^T), the sum any one rounding is relative to.
    A wrong expert, slot or weight costs the order of `scale` itself.
The twin itself is checked against a float64 per-token formula written independently of it, and
the runtime block's fused route against its per-expert loop.
"""

import pytest
import torch
import torch.nn.functional as F

from slimserve.eval.engine_bench import quantize_randomly
from slimserve.kernels import fused_moe as fm
from slimserve.kernels import reference
from slimserve.kernels.w4a16_layout import dequantize_torch, prepare_w4a16
from slimserve.runtime.layers import ops
from slimserve.runtime.models.fuse import fuse_linears
from slimserve.runtime.models.moe import MoeSpec, SparseMoeBlock

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
SMALL = fm.MoeConfig(16, 64, 64)  # one N tile and one or two K steps at these shapes
ULP = {BF16: 2.0**-7, F16: 2.0**-10, F32: 2.0**-23}


@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("SLIMSERVE_KERNELS", "triton")


def _routing(t, k, e, seed, mode="random"):
    """(topk_weights [T, k] fp32 summing to 1, topk_ids [T, k] int64 of distinct experts)."""
    g = torch.Generator().manual_seed(seed)
    if t == 0:
        ids = torch.zeros(0, k, dtype=torch.int64)
    elif mode == "one":  # every token to expert 1 (and, for k = 2, expert e - 1)
        ids = torch.tensor([1, e - 1][:k]).expand(t, k).contiguous()
    elif mode == "few":  # only experts 0 and 2: the others get no token
        ids = torch.stack([torch.randperm(2, generator=g)[:k] * 2 for _ in range(t)])
    else:
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    return (w / w.sum(-1, keepdim=True)).to(DEV), ids.to(DEV)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Signed codes [R, C] -> CT int32 words [R, ceil(C*bits/32)], offset binary."""
    per = 32 // bits
    fields = torch.zeros(codes.shape[0], -(-codes.shape[1] // per) * per, dtype=torch.int64)
    fields[:, : codes.shape[1]] = codes.long() + (1 << (bits - 1))
    words = (fields.reshape(codes.shape[0], -1, per) << (torch.arange(per) * bits)).sum(-1)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def _w4a16(e, n, k, dtype, seed, group_size=32, bits=4, asym=False, actorder=None):
    """Stacked W4A16 experts from random CT tensors; actorder None, "regular" (each expert its
    own permutation of k // g) or "irregular" (any group per column: gathered scales)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = -(1 << (bits - 1)), 1 << (bits - 1)
    groups = -(-k // group_size)
    experts = []
    for _ in range(e):
        g_idx = None
        if actorder == "irregular":
            g_idx = torch.randint(0, groups, (k,), generator=g, dtype=torch.int32)
        elif actorder == "regular":
            g_idx = (torch.arange(k) // group_size).to(torch.int32)[torch.randperm(k, generator=g)]
        zp = _pack(torch.randint(lo, hi, (groups, n), generator=g), bits).t().contiguous()
        ct = dict(
            weight_packed=_pack(torch.randint(lo, hi, (n, k), generator=g), bits),
            weight_scale=((torch.rand(n, groups, generator=g) + 0.5) / (8 << (bits - 4))).to(dtype),
            weight_zero_point=zp if asym else None,
            weight_g_idx=g_idx,
        )
        ct = {key: v.to(DEV) if v is not None else None for key, v in ct.items()}
        experts.append(
            prepare_w4a16(**ct, weight_shape=(n, k), group_size=group_size, num_bits=bits)
        )
    return fm.stack_w4a16(experts)


def _w8a8(e, n, k, seed, scale_dtype):
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-127, 128, (e, n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(e, n, generator=g) + 0.5) * 2.0**-9
    return fm.MoeW8A8Weight(w.to(DEV), s.to(scale_dtype).to(DEV))


def _dense(e, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(e, n, k, generator=g) * 0.1).to(dtype).to(DEV)


def _weights(variant, e, h, inter, dtype, seed):
    """(w_gate_up [E, 2I, H], w_down [E, H, I]) of one variant."""
    if variant == "dense":
        return _dense(e, 2 * inter, h, dtype, seed), _dense(e, h, inter, dtype, seed + 1)
    if variant == "w4a16":
        return (
            _w4a16(e, 2 * inter, h, dtype, seed, asym=True, actorder="regular"),
            _w4a16(e, h, inter, dtype, seed + 1, bits=8, actorder="irregular"),
        )
    sd = F32 if dtype == F32 else dtype
    return _w8a8(e, 2 * inter, h, seed, sd), _w8a8(e, h, inter, seed + 1, sd)


def _as_dense(w, dtype) -> torch.Tensor:
    """The fp32 [E, N, K] weight the kernel multiplies (W8A8: codes times scales)."""
    if isinstance(w, fm.MoeW4A16Weight):
        return torch.stack(
            [dequantize_torch(w.expert(e)).to(dtype).float() for e in range(w.num_experts)]
        )
    if isinstance(w, fm.MoeW8A8Weight):
        return w.weight.float() * w.scale.float()[..., None]
    return w.float()


# -- alignment -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "t,k,e,block_m,mode",
    [
        (1, 1, 4, 16, "random"),
        (5, 2, 8, 16, "random"),
        (33, 2, 4, 16, "random"),  # experts with more than one block
        (33, 1, 8, 16, "one"),  # every slot to one expert: three blocks, seven empty experts
        (33, 2, 8, 4, "few"),
        (7, 2, 64, 16, "random"),  # more experts than slots
        (0, 2, 4, 16, "random"),
    ],
)
def test_align_invariants(t, k, e, block_m, mode):
    _, ids = _routing(t, k, e, seed=t + e, mode=mode)
    al = fm.moe_align(ids, e, block_m)
    s = t * k
    flat = ids.reshape(-1).cpu()
    slots, owners = al.sorted_slots.cpu().long(), al.block_experts.cpu().long()
    counts = torch.bincount(flat, minlength=e)
    used = int((-(-counts // block_m)).sum())  # blocks the experts need
    assert al.num_slots == s and al.block_m == block_m
    assert slots.numel() == owners.numel() * block_m
    assert owners.numel() == fm.max_blocks(s, e, block_m) >= used
    assert int(al.num_padded) == used * block_m
    real = slots[slots < s]
    assert torch.equal(torch.sort(real).values, torch.arange(s))  # every slot exactly once
    assert bool((slots[slots >= s] == s).all())  # padding is marked with S
    assert bool((slots[used * block_m :] == s).all()) and bool((owners[used:] == -1).all())
    assert bool((owners[:used] >= 0).all())
    for b in range(used):
        blk = slots[b * block_m : (b + 1) * block_m]
        mine = blk[blk < s]
        assert bool((flat[mine] == owners[b]).all())  # every block holds one expert's slots
        assert torch.equal(mine, torch.sort(mine).values)  # in slot order (a stable sort)
    for x in range(e):  # each expert's slots fill ceil(c / block_m) consecutive blocks
        assert int((owners == x).sum()) == -(-int(counts[x]) // block_m)


def test_align_rejects_bad_arguments():
    ids = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="block_m=24"):
        fm.moe_align(ids, 4, 24)
    with pytest.raises(ValueError, match="num_experts=0"):
        fm.moe_align(ids, 0, 16)
    with pytest.raises(ValueError, match="topk_ids has dtype float32"):
        fm.moe_align(ids.float(), 4, 16)


# -- one grouped GEMM ------------------------------------------------------------------------


GEMM_CASES = [
    # (variant, dtype, T, k, E, N, K, routing weights)
    ("dense", BF16, 33, 2, 4, 64, 64, False),
    ("dense", F32, 5, 2, 8, 48, 40, True),  # N, K off the tiles
    ("dense", F16, 1, 1, 4, 64, 96, True),
    ("w4a16-sym4", BF16, 33, 2, 4, 64, 64, True),
    ("w4a16-asym8-regular", F16, 5, 2, 8, 64, 64, False),
    ("w4a16-sym4-irregular", BF16, 5, 1, 4, 40, 96, True),
    ("w8a8", BF16, 33, 2, 4, 64, 64, True),
    ("w8a8", F32, 5, 1, 8, 40, 72, False),
]


def _gemm_weight(variant, e, n, k, dtype, seed):
    if variant == "dense":
        return _dense(e, n, k, dtype, seed)
    if variant == "w8a8":
        return _w8a8(e, n, k, seed, dtype)
    _, sym, *order = variant.split("-")
    return _w4a16(
        e, n, k, dtype, seed, bits=int(sym[-1]), asym=sym.startswith("asym"),
        actorder=order[0] if order else None,
    )  # fmt: skip


@pytest.mark.parametrize("case", GEMM_CASES, ids=lambda c: f"{c[0]}-{c[1]}-T{c[2]}k{c[3]}E{c[4]}")
def test_moe_gemm_matches_twin(case):
    variant, dtype, t, k, e, n, kk, with_rw = case
    rw, ids = _routing(t, k, e, seed=3 * t + e)
    rw = rw if with_rw else None
    w = _gemm_weight(variant, e, n, kk, dtype, seed=t)
    g = torch.Generator().manual_seed(5)
    for x_div, rows in ((k, t), (1, t * k)):  # gate/up (rows by token), down (rows by slot)
        x = torch.randn(rows, kk, generator=g).to(dtype).to(DEV)
        align = fm.moe_align(ids, e, SMALL.block_m)
        if variant == "w8a8":
            q, qs = reference.quantize_per_token_int8(x)
            got = fm.moe_gemm(q, w, align, x_div, rw, a_scale=qs, out_dtype=dtype, config=SMALL)
            want = fm.moe_gemm_torch(q, w, ids, x_div, rw, a_scale=qs, out_dtype=dtype)
            fin = torch.finfo(dtype)
            r = want.float().abs().clamp_min(fin.tiny)
            ulp = torch.exp2(torch.floor(torch.log2(r))) * fin.eps
            assert bool(((got.float() - want.float()).abs() <= ulp).all())
            continue
        got = fm.moe_gemm(x, w, align, x_div, rw, config=SMALL)
        want = fm.moe_gemm_torch(x, w, ids, x_div, rw)
        assert got.shape == want.shape == (t * k, n) and got.dtype == dtype
        absw = rw.abs().reshape(-1, 1).float() if rw is not None else 1.0
        scale = fm.moe_gemm_torch(x.abs().float(), _as_dense(w, dtype).abs(), ids, x_div) * absw
        bound = ULP[dtype] * want.float().abs() + 2 * kk * 2.0**-24 * scale + 2.0**-24
        err = (got.float() - want.float()).abs()
        assert bool((err <= bound).all()), f"x_div {x_div}: err {err.max():.3g}"


# -- the whole FFN ---------------------------------------------------------------------------

FFN_CASES = [
    # (variant, dtype, T, k, E, I, routing mode)
    ("dense", BF16, 1, 2, 4, 32, "random"),
    ("dense", BF16, 33, 2, 8, 64, "random"),
    ("dense", F32, 5, 2, 8, 32, "few"),  # six experts without a token
    ("dense", BF16, 33, 1, 4, 32, "one"),  # every token to one expert
    ("w4a16", BF16, 5, 2, 8, 32, "random"),
    ("w4a16", F16, 33, 1, 4, 64, "one"),
    ("w8a8", BF16, 33, 2, 4, 32, "random"),
    ("w8a8", F32, 5, 2, 8, 64, "few"),
]


def _ffn_bound(x, wgu, wd, rw, ids, dtype) -> torch.Tensor:
    """2^-5 (16-bit, or W8A8, where one flipped code costs a scale step of 2^-7 of the row's
    absmax) or 2^-14 (fp32) of sum_j |rw_j| (|act_j| @ |W_down|^T) (module docstring)."""
    t, k = ids.shape
    act = reference.silu_and_mul(fm.moe_gemm_torch(x.float(), _as_dense(wgu, dtype), ids, k))
    scale = fm.moe_gemm_torch(act.abs(), _as_dense(wd, dtype).abs(), ids, 1, rw.abs())
    tight = dtype == F32 and not isinstance(wd, fm.MoeW8A8Weight)
    return scale.view(t, k, -1).sum(1) * (2.0**-14 if tight else 2.0**-5)


@pytest.mark.parametrize(
    "case", FFN_CASES, ids=lambda c: f"{c[0]}-{c[1]}-T{c[2]}k{c[3]}E{c[4]}-{c[6]}"
)
def test_fused_moe_matches_twin(triton_backend, case):
    variant, dtype, t, k, e, inter, mode = case
    h = 64
    rw, ids = _routing(t, k, e, seed=t * k + e, mode=mode)
    wgu, wd = _weights(variant, e, h, inter, dtype, seed=e + inter)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(t)).to(dtype).to(DEV)
    got = fm.fused_moe(x, wgu, wd, rw.to(dtype), ids, config=SMALL)
    want = fm.fused_moe_torch(x, wgu, wd, rw.to(dtype), ids)
    assert got.shape == want.shape == (t, h) and got.dtype == want.dtype == dtype
    err = (got.float() - want.float()).abs()
    bound = _ffn_bound(x, wgu, wd, rw.to(dtype).float(), ids, dtype)
    assert bool((err <= bound).all()), f"err {err.max():.3g} > bound {bound.min():.3g}"


@pytest.mark.parametrize("t,e,row", [(1, 8, 0), (33, 4, 1), (130, 4, 2)])  # slots per expert
def test_default_config(triton_backend, t, e, row):
    k, h, inter = 2, 64, 64
    assert fm.select_config(t * k, e) is fm.DISPATCH[row][1]
    rw, ids = _routing(t, k, e, seed=11)
    wgu, wd = _weights("dense", e, h, inter, BF16, seed=2)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(BF16).to(DEV)
    got = fm.fused_moe(x, wgu, wd, rw, ids)
    err = (got.float() - fm.fused_moe_torch(x, wgu, wd, rw, ids).float()).abs()
    assert bool((err <= _ffn_bound(x, wgu, wd, rw, ids, BF16)).all())


def _per_token_reference(x, wgu, wd, rw, ids) -> torch.Tensor:
    """float64, token by token: sum_j rw[t, j] * down_e(silu(gate_e x) * up_e x)."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    x, wgu, wd, rw = x.double().cpu(), wgu.double().cpu(), wd.double().cpu(), rw.double().cpu()
    inter = wd.shape[2]
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            g, u = (wgu[e] @ x[t]).split(inter)
            out[t] += rw[t, j] * (wd[e] @ (F.silu(g) * u))
    return out


@pytest.mark.parametrize("mode", ["random", "few", "one"])
def test_twin_matches_an_independent_formula(mode):
    """The twin's slot bookkeeping (grouping, weights, the k-sum) against the plain formula."""
    t, k, e, h, inter = 9, 2, 8, 64, 32
    rw, ids = _routing(t, k, e, seed=4, mode=mode)
    wgu, wd = _weights("dense", e, h, inter, F32, seed=9)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(2)).to(DEV)
    got = fm.fused_moe_torch(x, wgu, wd, rw, ids)
    want = _per_token_reference(x, wgu, wd, rw, ids)
    assert torch.allclose(got.double().cpu(), want, rtol=1e-5, atol=1e-5)


def test_torch_backend_is_the_twin(monkeypatch):
    monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")
    rw, ids = _routing(5, 2, 4, seed=1)
    wgu, wd = _weights("w8a8", 4, 64, 32, BF16, seed=1)
    x = torch.randn(5, 64).to(BF16).to(DEV)
    assert torch.equal(fm.fused_moe(x, wgu, wd, rw, ids), fm.fused_moe_torch(x, wgu, wd, rw, ids))


def test_empty_batch(triton_backend):
    wgu, wd = _weights("dense", 4, 64, 32, BF16, seed=1)
    x = torch.zeros(0, 64, dtype=BF16, device=DEV)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEV)
    assert fm.fused_moe(x, wgu, wd, torch.zeros(0, 2, device=DEV), ids).shape == (0, 64)


def test_argument_errors(triton_backend):
    rw, ids = _routing(3, 2, 4, seed=1)
    wgu, wd = _weights("dense", 4, 64, 32, BF16, seed=1)
    x = torch.randn(3, 64).to(BF16).to(DEV)
    with pytest.raises(ValueError, match="w_gate_up has dtype float16"):
        fm.fused_moe(x, wgu.half(), wd, rw, ids)
    with pytest.raises(ValueError, match=r"expected \[E, 2I, H=64\] and \[E, H=64, I\]"):
        fm.fused_moe(x, wgu, wd[:, :, :16], rw, ids)
    with pytest.raises(ValueError, match=r"topk_ids has shape \(2, 2\)"):
        fm.fused_moe(x, wgu, wd, rw[:2], ids[:2])
    with pytest.raises(ValueError, match="topk_weights has shape"):
        fm.fused_moe(x, wgu, wd, rw[:, :1], ids)
    q4 = _weights("w4a16", 4, 64, 32, BF16, seed=1)
    with pytest.raises(ValueError, match="W4A16 experts take float16 or bfloat16"):
        fm.fused_moe(x.float(), *q4, rw, ids)
    with pytest.raises(ValueError, match="block_m=32 but the alignment's block_m is 16"):
        fm.moe_gemm(x, wgu, fm.moe_align(ids, 4, 16), 2, config=fm.MoeConfig(32, 64, 64))
    with pytest.raises(ValueError, match="config.block_k=16"):
        q8 = _weights("w8a8", 4, 64, 32, BF16, seed=1)[0]
        q, s = reference.quantize_per_token_int8(x)
        fm.moe_gemm(q, q8, fm.moe_align(ids, 4, 16), 2, a_scale=s, config=fm.MoeConfig(16, 64, 16))
    one = _w4a16(1, 64, 64, BF16, 0)
    other = _w4a16(1, 64, 64, BF16, 0, group_size=64)
    with pytest.raises(ValueError, match="expert 1's W4A16 layout"):
        fm.stack_w4a16([one.expert(0), other.expert(0)])


def test_aot_variants_cover_every_row_and_branch():
    variants = fm.aot_variants()
    names = [v.name for v in variants]
    assert len(names) == len(set(names))
    for _, cfg in fm.DISPATCH:
        tile = f"{cfg.block_m}x{cfg.block_n}x"
        for kind in ("dense", "w4a16", "w8a8"):
            assert any(n.startswith(f"moe_{kind}_{tile}") for n in names), (kind, tile)
    for flag in ("_perm", "_gather", "_rw", "_asym", "_sym", "_w8", "_w4", "x32_"):
        assert any(flag in n for n in names if n.startswith("moe_w4a16")), flag
    assert {"moe_dense_16x64x64_fp32_rw", "moe_w8a8_16x64x64_fp16"} <= set(names)


# -- the runtime block on the fused route ----------------------------------------------------


def _block(weights: str, fuse: bool, shared: int = 0) -> SparseMoeBlock:
    """A tiny Qwen-MoE block (H 64, I 32, 4 experts, top-2) in bf16, random weights."""
    spec = MoeSpec(
        num_experts=4,
        top_k=2,
        intermediate_size=32,
        renormalize=True,
        weights_fp32=False,
        shared_intermediate_size=shared,
        block_name="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        sparse_layers=(True,),
    )
    torch.manual_seed(0)
    block = SparseMoeBlock(64, spec).to(BF16).to(DEV)
    if weights != "dense":
        quantize_randomly(block.experts, group_size=32, seed=1, scheme_name=weights)
    if fuse:
        for ex in block.experts:
            fused = fuse_linears([ex.gate_proj, ex.up_proj])
            del ex.gate_proj, ex.up_proj
            ex.gate_up_proj = fused
    return block.eval()


@pytest.mark.parametrize(
    "weights,fuse,shared",
    [("dense", True, 0), ("dense", False, 48), ("W4A16", True, 0), ("W8A8", False, 0)],
)
def test_block_fused_route_matches_the_loop(monkeypatch, weights, fuse, shared):
    block = _block(weights, fuse, shared)
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(3)).to(BF16).to(DEV)
    monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")
    with torch.no_grad():
        loop = block(x, ops.TORCH)  # the per-expert loop through the twins
        assert "_stacked" not in block.__dict__  # the CPU path never stacks
        monkeypatch.setenv("SLIMSERVE_KERNELS", "triton")
        fused = block(x, ops.triton_ops())
        assert block.__dict__["_stacked"][1] is not None  # the fused route was taken
        monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")
        again = block(x, ops.TORCH)
    # the loop through the experts' rebound Linears (views into the stacked weights): unchanged
    assert torch.equal(again, loop)
    # the loop rounds each expert's output and weights it in bf16, then adds in bf16: a few
    # bf16 ulps of the block's output apart from the fused path's single roundings
    scale = loop.float().abs().amax()
    err = (fused.float() - loop.float()).abs().max()
    assert err <= 2.0**-5 * scale, f"err {err:.3g}, output scale {scale:.3g}"


def test_block_keeps_the_loop_where_experts_do_not_stack(monkeypatch):
    """W4A16 gate and up left unfused (their N-last layout cannot be sliced into contiguous
    views) and fp32 activations: no stacking, the loop runs."""
    monkeypatch.setenv("SLIMSERVE_KERNELS", "torch")
    block = _block("W4A16", fuse=False)
    x = torch.randn(3, 64).to(BF16).to(DEV)
    with torch.no_grad():
        want = block(x, ops.TORCH)
        got = block(x, ops.triton_ops())  # the loop, silu-and-mul through its kernel
    assert block.__dict__["_stacked"][1] is None
    assert (got.float() - want.float()).abs().max() <= 2.0**-6 * want.float().abs().amax()
    dense = _block("dense", fuse=True).float()
    with torch.no_grad():
        dense(x.float(), ops.triton_ops())
    assert dense.__dict__["_stacked"][1] is None
