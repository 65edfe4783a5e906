"""kernel_bench's plans: every size a run uses. `full` (GPU), `quick` (GPU smoke) and `cpu`
(Triton interpreter), plus each section's child time limit."""

from __future__ import annotations

from dataclasses import dataclass, field

SECTIONS = ("w4a16", "w8a8", "attn", "norm", "e2e")


@dataclass(frozen=True)
class Plan:
    """Every size the run uses. `full` (GPU), `quick` (GPU smoke) and `cpu` (interpreter)."""

    name: str
    timings: bool
    group: int  # W4A16 group size
    w4_sym: tuple  # ((N, K), Ms) for the symmetric checks, fp16 and bf16
    w4_var: tuple  # ((N, K), Ms) for the asymmetric / act-order checks
    w8_nk: tuple  # (N, K) pairs for the W8A8 checks
    w8_ms: tuple
    aq_shapes: tuple  # act_quant check shapes
    rows: tuple  # (T, hidden, intermediate) of the row-kernel checks
    attn: tuple  # (H, Hkv, D, block_size)
    dec_ctx: tuple  # decode check contexts (one sequence each)
    prefill: tuple  # (q_lens, contexts) of the prefill check
    kv_tokens: int
    cpu_tiles: bool = False  # big forced tiles for the interpreter
    t_nk: tuple = ()  # (N, K) of the GEMM timings
    t_w4_ms: tuple = ()
    t_w8_ms: tuple = ()
    sweep_w4: int = 0  # candidates a point (0: no sweep)
    sweep_w8_ms: tuple = ()
    dec_batch: int = 64
    t_dec_ctx: tuple = ()
    t_prefill: tuple = (512, 4096)  # (new tokens, cached tokens before them)
    t_rows: tuple = (4096, 4096, 11008)
    warmup: int = 10
    rep: int = 50
    sweep_rep: int = 20
    e2e: tuple = ()
    limits: dict = field(default_factory=dict)  # section -> child time limit, seconds


_LLAMA = dict(
    group=128,
    w4_sym=((4096, 11008), (1, 16, 33, 300, 1024)),
    w4_var=((4096, 4096), (1, 64, 1024)),
    w8_nk=((11008, 4096), (4096, 11008)),
    w8_ms=(1, 16, 300, 1024),
    aq_shapes=((1024, 4096), (257, 11008)),
    rows=(1024, 4096, 11008),
    attn=(32, 8, 128, 16),
    dec_ctx=(1, 15, 16, 17, 500, 1024, 4100, 8192),
    prefill=((512, 7, 100, 1), (4608, 300, 100, 2000)),
    kv_tokens=4096,
)
_E2E = ("--shape", "llama-7b", "--device", "cuda", "--max-num-seqs", "128")
PLANS = {
    "full": Plan(
        "full",
        True,
        **_LLAMA,
        t_nk=((4096, 4096), (11008, 4096), (4096, 11008)),
        t_w4_ms=(1, 4, 16, 64, 256, 4096),
        t_w8_ms=(256, 1024, 2048, 4096, 8192),
        sweep_w4=8,
        sweep_w8_ms=(1024, 2048, 4096, 8192),
        t_dec_ctx=(512, 1024, 2048, 4096, 8192),
        e2e=_E2E
        + (
            "--num-prompts",
            "128",
            "--input-len",
            "256",
            "--output-len",
            "128",
            "--kv-cache-memory",
            "30GiB",
        ),
        limits=dict(w4a16=125, w8a8=70, attn=70, norm=35, e2e=130),
    ),
    "quick": Plan(
        "quick",
        True,
        **{
            **_LLAMA,
            "w4_sym": ((4096, 11008), (1, 300, 1024)),
            "w8_ms": (16, 1024),
            "dec_ctx": (17, 4100),
        },
        t_nk=((4096, 4096),),
        t_w4_ms=(1, 16, 256),
        t_w8_ms=(1024,),
        sweep_w4=3,
        sweep_w8_ms=(1024,),
        dec_batch=16,
        t_dec_ctx=(1024, 4096),
        t_rows=(1024, 4096, 11008),
        warmup=5,
        rep=20,
        sweep_rep=10,
        e2e=_E2E
        + (
            "--num-prompts",
            "16",
            "--input-len",
            "128",
            "--output-len",
            "32",
            "--kv-cache-memory",
            "8GiB",
        ),
        limits=dict(w4a16=90, w8a8=60, attn=60, norm=30, e2e=100),
    ),
    "cpu": Plan(
        "cpu",
        False,
        group=32,
        w4_sym=((72, 192), (1, 33, 600)),
        w4_var=((64, 128), (1, 7)),
        w8_nk=((96, 200),),
        w8_ms=(1, 33),
        aq_shapes=((7, 200), (3, 1000)),
        rows=(7, 1000, 1000),
        attn=(8, 2, 32, 16),
        dec_ctx=(1, 17, 40),
        prefill=((7, 1), (40, 30)),
        kv_tokens=37,
        cpu_tiles=True,
    ),
}
