"""The prepared GPU check: everything a session with a GPU should measure, in one command.

    python -m slimserve.eval.gpu_check [--budget-s 480] [--out DIR] [--hbm-tbps 4.8]
    python -m slimserve.eval.gpu_check --dry-run        # CPU: the same plan at tiny shapes
    python -m slimserve.eval.gpu_check --steps decode,hf --weights bf16,W4A16 --kv auto

In order, each step in a child process with its own time limit (a CUDA fault or a hang in one
cannot take the others down; whatever a step saved comes back):

1. **kernels**: correctness of every Triton kernel against its torch twin, then quick timings
   (`python -m slimserve.eval.kernels.bench --quick --sections w4a16,w8a8,attn,norm`).
2. **decode**: engine decode throughput on random weights of the Llama-3-8B shape (hidden 4096,
   intermediate 14336, 32 layers, 32 query / 8 KV heads, vocab 128256) for bf16, W4A16 (int4,
   group 128) and W8A8 weights, with a bf16 and an FP8 KV cache, at batch 1, 16, 64 and 256:
   prompts of 128 tokens are prefilled, then 32 decode steps are timed (synchronized). Beside
   each row the HBM roofline: the bytes one decode step must read (every weight once, plus each
   sequence's K and V so far) over `--hbm-tbps`. Each configuration runs eagerly, then with
   its decode steps replayed from CUDA graphs (runtime/worker/cuda_graphs.py; the dry run pads into the
   same static buffers without capturing).
3. **transformers**: `generate` (its default dynamic cache, eager: a static cache makes it
   torch.compile the forward for every batch shape, minutes each) on the same shape in bf16 at
   the same batch sizes (decode rate = the 33-token run minus the 1-token run), the baseline of
   the bf16 rows.
4. **tensor parallel**: the 8B shape's decode rate through the engine at TP=2 (mp executor,
   NCCL, bf16 weights and KV, eager, the same batches; rank 0's collective time per step from
   `ModelRunner.comm_stats()`), from a random checkpoint written to a temporary folder (the
   ranks load their slices from files). This needs two GPUs: on one GPU the entry is TP=1 only,
   the bf16 eager rows of step 2, and the output says "one GPU: TP=1 only". The dry run runs
   TP=2 over two CPU processes (gloo) at the tiny shape.
5. **kv decode**: the paged decode attention kernel alone (`kernels/paged_attention.py`) over
   bf16, FP8, INT8 and INT4 caches at 8k and 32k contexts, batch 16, the 8B's attention shape
   (32 query / 8 KV heads, head_dim 128, blocks of 16 scattered over the cache): microseconds a
   call (median of 20 after 3 warm-up calls, synchronized), each against bf16 and fp8, and the
   cache bytes read per second. INT8 / INT4 read uint8 rows (codes, then an fp16 scale and zero
   per token and KV head: kernels/kv_quant.py) and dequantize in the kernel.
6. **moe**: the fused mixture-of-experts FFN (`kernels/fused_moe.py`) at a Qwen3-MoE-like shape
   (64 experts, top-8, hidden 2048, expert intermediate 768; 1, 16 and 256 tokens, a random
   router) for bf16, W4A16 (int4, group 128) and W8A8 experts: its largest error against its
   torch twin (over the twin's largest value; the row fails above 2^-5) and against the
   per-expert loop it replaces (runtime/models/moe.py `SparseMoeBlock.experts_loop`, the same
   experts through their own GEMMs), and microseconds a call of both (median of 20, as step 5).
7. **sweeps**: the W4A16 / W8A8 tile sweeps of the kernel benchmark's full plan, if the budget
   has at least 150 s left.

It prints one table (hardware, model shape and workload in its header), the tensor-parallel
one, the KV-decode one and the MoE one, and writes `gpu_check.json` (default: $OUT, else the current folder). `--dry-run` runs the
same steps on the CPU at tiny shapes, the kernels through the Triton interpreter, so CI keeps
the script working (tests/eval/test_gpu_check.py); its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from slimserve.eval.engine_bench import SHAPES, build_engine, quantize_randomly
from slimserve.runtime.bench.sysinfo import hardware_info, hardware_line
from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.layers.ops import select
from slimserve.runtime.models.fuse import fuse_linears
from slimserve.runtime.models.llama import ModelSpec
from slimserve.runtime.models.load import random_model
from slimserve.runtime.models.moe import MoeSpec, SparseMoeBlock
from slimserve.runtime.stats.rank_stats import model_bytes
from slimserve.runtime.worker.cuda_graphs import DecodeGraphs

WEIGHTS = ("bf16", "W4A16", "W8A8")
KV = ("auto", "fp8_e4m3")  # the decode rows' default caches
KV_CHOICES = (*KV, "int8", "int4")  # what --kv may list
KV_DECODE = ("bf16", "fp8", "int8", "int4")  # the kv-decode step's caches
STEPS = ("kernels", "decode", "hf", "tp", "kvdecode", "moe", "sweeps")
MOE_TOL = 2.0**-5  # the moe rows' largest |fused - twin| over the twin's largest |value|


def _choices(allowed: tuple[str, ...]):
    """An argparse type: a comma list of `allowed` names, with one line naming a bad one."""

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in allowed]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"{','.join(bad) or 'nothing'} is not one of {','.join(allowed)}"
            )
        return names

    return parse


def _plan(dry_run: bool) -> dict:
    if dry_run:
        tiny = replace(
            SHAPES["demo"],
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_layers=1,
            num_heads=4,
            num_kv_heads=2,
            head_dim=32,
            inv_freq=SHAPES["demo"].inv_freq[:16],
        )
        # fp16: the Triton kernels take fp16/bf16 only, and the interpreter runs fp16
        return {
            "shape": "tiny",
            "spec": tiny,
            "device": "cpu",
            "dtype": torch.float16,
            "batches": (2,),
            "prompt_len": 8,
            "steps": 2,
            "warmup": 0,
            "max_model_len": 64,
            "kv_cache_memory": "16MiB",
            # batch, contexts, (query heads, KV heads, head_dim, block size), timed calls
            "kv_decode": {"batch": 2, "contexts": (40, 100), "attn": (4, 2, 32, 16), "reps": 1},
            # tokens, experts, top-k, hidden, expert intermediate, W4A16 group, timed calls
            "moe": {
                "tokens": (1, 5),
                "experts": 8,
                "top_k": 2,
                "hidden": 64,
                "inter": 32,
                "group": 32,
                "reps": 1,
            },
            "limits": {
                "kernels": 300,
                "decode": 300,
                "hf": 120,
                "tp": 200,
                "kvdecode": 60,
                "moe": 120,
                "sweeps": 0,
            },
        }
    return {
        "shape": "llama3-8b",
        "spec": SHAPES["llama3-8b"],
        "device": "cuda",
        "dtype": torch.bfloat16,
        "batches": (1, 16, 64, 256),
        "prompt_len": 128,
        "steps": 32,
        "max_model_len": 512,
        "warmup": 4,
        "kv_cache_memory": "8GiB",
        "kv_decode": {"batch": 16, "contexts": (8192, 32768), "attn": (32, 8, 128, 16), "reps": 20},
        # Qwen3-30B-A3B's expert block: 128 experts top-8 there; 64 here (half the weights)
        "moe": {
            "tokens": (1, 16, 256),
            "experts": 64,
            "top_k": 8,
            "hidden": 2048,
            "inter": 768,
            "group": 128,
            "reps": 20,
        },
        "limits": {
            "kernels": 200,
            "decode": 200,
            "hf": 90,
            "tp": 300,
            "kvdecode": 90,
            "moe": 120,
            "sweeps": 150,
        },
    }


# -- step 2: the engine's decode rate --------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_rate(engine, batch: int, prompt_len: int, steps: int, warmup: int, device: str) -> dict:
    """Prefill `batch` random prompts, take `warmup` decode steps, then time `steps` more."""
    g = torch.Generator().manual_seed(batch)
    vocab = engine.runner.spec.vocab_size
    # Room to run to the end: sequences prefilled in the first chunks decode while the later
    # ones prefill (at batch 256 x 128 tokens, 4 steps more), so `warmup + steps` is too few.
    params = SamplingParams(
        max_tokens=engine.runner.max_model_len - prompt_len, temperature=0.0, ignore_eos=True
    )
    rids = [f"b{batch}-{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(
            rid, torch.randint(0, vocab, (prompt_len,), generator=g).tolist(), params
        )
    started: set[str] = set()
    while len(started) < batch:  # prefill (chunked) until every sequence has its first token
        started.update(out.request_id for out in engine.step())
    for _ in range(warmup):
        engine.step()
    _sync(device)
    t0 = time.perf_counter()
    decoded = 0
    for _ in range(steps):
        decoded += len(engine.step())
    _sync(device)
    dt = time.perf_counter() - t0
    for rid in rids:
        engine.abort_request(rid)
    assert decoded == batch * steps, f"{decoded} tokens in {steps} steps of batch {batch}"
    return {
        "step_ms": 1e3 * dt / steps,
        "tok_s": batch * steps / dt,
        "mean_context": prompt_len + warmup + steps / 2,
    }


def step_bytes(engine, batch: int, context: float, spec: ModelSpec) -> float:
    """Bytes one decode step must read: every weight once (the embedding only for the batch's
    rows) and the K and V of every cached token of every sequence."""
    model = engine.runner.model
    weights = model_bytes(model)  # in their run-time form: the W4A16 repack counted
    emb = next(m for m in model.modules() if isinstance(m, torch.nn.Embedding)).weight
    weights -= emb.numel() * emb.element_size() * (1 - batch / emb.shape[0])
    # per layer: an fp8 cache keeps the artifact's skipped layers unquantized (runner.kv_dtypes);
    # a row of an int8 / int4 cache is its codes plus scale and zero (its last dimension)
    row_bytes = sum(k.shape[-1] * k.element_size() for k, _ in engine.runner.kv_caches)
    kv = batch * context * 2 * spec.num_kv_heads * row_bytes
    return weights + kv


def _add_graphs(engine, plan: dict) -> str:
    """Give the engine's runner decode CUDA graphs (captured on CUDA; on the CPU the same static
    buffers run eagerly): the row label."""
    runner = engine.runner
    runner.graphs = DecodeGraphs(
        runner.model,
        runner.kv_caches,
        max(plan["batches"]),
        -(-runner.max_model_len // runner.block_size),
        runner.block_size,
        runner.device,
    )
    if runner.device.type != "cuda":
        return "static"
    runner.graphs.capture()
    return "on"


def run_decode(plan: dict, hbm_tbps: float) -> list[dict]:
    rows = []
    for weights in plan.get("weights", WEIGHTS):
        for kv in plan.get("kv", KV):
            row0 = {
                "weights": weights,
                "kv": {"fp8_e4m3": "fp8", "int8": "int8", "int4": "int4"}.get(kv, "bf16"),
                "graphs": "off",
            }
            if plan["device"].startswith("cuda"):
                torch.cuda.empty_cache()
            try:
                engine = build_engine(
                    plan["spec"],
                    quant=False if weights == "bf16" else weights,
                    kv_cache_dtype=kv,
                    device=plan["device"],
                    dtype=plan["dtype"],
                    max_num_seqs=max(plan["batches"]),
                    max_num_batched_tokens=8192,
                    kv_cache_memory=plan["kv_cache_memory"],
                    max_model_len=plan["max_model_len"],  # bounds the graphs' attention grid
                    cuda_graphs=False,  # eager rows first; _add_graphs adds them to the same engine
                )
                if plan["device"].startswith("cuda"):  # compile every kernel before timing
                    decode_rate(engine, 1, plan["prompt_len"], 2, 1, plan["device"])
                for graphs in ("off", "on"):
                    if graphs == "on":  # the same engine, decode steps now replayed from graphs
                        row0["graphs"] = _add_graphs(engine, plan)
                    for batch in plan["batches"]:  # one failed batch keeps the others' rows
                        try:
                            r = decode_rate(
                                engine,
                                batch,
                                plan["prompt_len"],
                                plan["steps"],
                                plan["warmup"],
                                plan["device"],
                            )
                        except Exception:
                            rows.append(
                                {**row0, "batch": batch, "error": traceback.format_exc()[-2000:]}
                            )
                            print(
                                f"decode {weights} KV {kv} graphs {row0['graphs']} batch {batch}: "
                                f"FAILED\n{traceback.format_exc()[-1500:]}",
                                flush=True,
                            )
                            continue
                        nbytes = step_bytes(engine, batch, r["mean_context"], plan["spec"])
                        roof = batch / (nbytes / (hbm_tbps * 1e12))
                        rows.append(
                            {
                                **row0,
                                "batch": batch,
                                **r,
                                "bytes_per_step": nbytes,
                                "roofline_tok_s": roof,
                                "roofline_share": r["tok_s"] / roof,
                            }
                        )
                        print(
                            f"decode {weights:>5} KV {row0['kv']:>4} graphs {row0['graphs']:>6} "
                            f"batch {batch:>3}: {r['tok_s']:9.1f} tok/s, {r['step_ms']:7.2f} "
                            f"ms/step, {100 * r['tok_s'] / roof:5.1f}% of roofline",
                            flush=True,
                        )
                del engine
            except Exception:
                rows.append({**row0, "error": traceback.format_exc()[-2000:]})
                print(
                    f"decode {weights} KV {kv}: FAILED\n{traceback.format_exc()[-1500:]}",
                    flush=True,
                )
            if plan["device"].startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


# -- step 5: the paged decode kernel over bf16 / fp8 / int8 / int4 caches ------------------------


def _kv_caches(kind: str, nblk: int, hkv: int, d: int, bs: int, dtype, device: str):
    """(K, V, k_scale, v_scale) caches of `kind` over `nblk` blocks of random N(0, 1) values:
    fp8 with scale 1, int8 / int4 as the rows the engine writes (kernels/kv_quant.py)."""
    from slimserve.kernels import kv_quant

    g = torch.Generator(device=device).manual_seed(nblk)
    out = []
    for _ in range(2):
        x = torch.randn(nblk, bs, hkv, d, generator=g, device=device, dtype=dtype)
        if kind == "fp8":
            x = x.to(torch.float8_e4m3fn)
        elif kind in ("int8", "int4"):
            x = kv_quant.quantize_rows(x, int(kind[3:]))
        out.append(x)
    return out[0], out[1], 1.0, 1.0


def _time_call(fn, reps: int, device: str) -> float:
    """Median microseconds of `reps` synchronized calls after 3 warm-up calls (one in a dry run)."""
    for _ in range(3 if reps > 1 else 1):
        fn()
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e6 * (time.perf_counter() - t0))
    return sorted(times)[len(times) // 2]


def run_kv_decode(plan: dict) -> list[dict]:
    """The paged decode kernel alone over each cache of KV_DECODE at each context: us a call,
    GB/s of cache read, and the ratio to the bf16 and fp8 rows of the same context."""
    from slimserve.kernels import paged_attention as PA

    cfg, dev, dtype = plan["kv_decode"], plan["device"], plan["dtype"]
    h, hkv, d, bs = cfg["attn"]
    b, rows = cfg["batch"], []
    for ctx in cfg["contexts"]:
        per_seq = -(-ctx // bs)
        nblk = b * per_seq + 3
        g = torch.Generator().manual_seed(ctx)
        tables = torch.randperm(nblk, generator=g)[: b * per_seq].view(b, per_seq).int().to(dev)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(b, h, d, generator=g).to(dev, dtype)
        base = {}
        for kind in KV_DECODE:
            row = {"kv": kind, "batch": b, "ctx": ctx}
            try:
                kc, vc, ks, vs = _kv_caches(kind, nblk, hkv, d, bs, dtype, dev)

                def call(kc=kc, vc=vc, ks=ks, vs=vs):
                    return PA.paged_attention_decode(q, kc, vc, tables, lens, d**-0.5, ks, vs)

                us = _time_call(call, cfg["reps"], dev)
                read = 2 * b * ctx * hkv * kc.shape[-1] * kc.element_size()
                row.update(us=us, gb_s=read / us / 1e3, bytes_read=read)
                base[kind] = us
                for ref in ("bf16", "fp8"):
                    if ref in base and kind != ref:
                        row[f"x_{ref}"] = base[ref] / us  # > 1: faster than that cache
                del kc, vc
            except Exception:
                row["error"] = traceback.format_exc()[-2000:]
                print(f"kv decode {kind} ctx {ctx}: FAILED\n{row['error'][-1500:]}", flush=True)
            rows.append(row)
            if "us" in row:
                print(
                    f"kv decode {kind:>4} ctx {ctx:>6} batch {b}: {row['us']:10.1f} us, "
                    f"{row['gb_s']:7.1f} GB/s",
                    flush=True,
                )
            if dev.startswith("cuda"):
                torch.cuda.empty_cache()
    return rows


def _kv_decode_table(rows: list[dict], plan: dict) -> str:
    h, hkv, d, bs = plan["kv_decode"]["attn"]
    lines = [
        f"Paged decode attention alone | {h} query / {hkv} KV heads, head_dim {d}, blocks of "
        f"{bs}, scattered | batch {plan['kv_decode']['batch']}",
        "| ctx | KV | us | GB/s of cache | x bf16 (time) | x fp8 (time) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "us" not in r:
            lines.append(f"| {r['ctx']} | {r['kv']} | FAILED | | | |")
            continue
        xs = [f"{r[k]:.2f}x" if k in r else "" for k in ("x_bf16", "x_fp8")]
        lines.append(
            f"| {r['ctx']} | {r['kv']} | {r['us']:.1f} | {r['gb_s']:.1f} | {xs[0]} | {xs[1]} |"
        )
    return "\n".join(lines)


# -- step 6: the fused MoE FFN against its twin and the per-expert loop ----------------------------


def _moe_block(cfg: dict, weights: str, device: str, dtype: torch.dtype) -> SparseMoeBlock:
    """A block of random experts (`weights`: bf16, W4A16 or W8A8) with each expert's gate and
    up fused into one Linear, as the engine loads them (runtime/models/fuse.py)."""
    spec = MoeSpec(
        num_experts=cfg["experts"],
        top_k=cfg["top_k"],
        intermediate_size=cfg["inter"],
        renormalize=True,
        weights_fp32=False,
        shared_intermediate_size=0,
        block_name="mlp",
        expert_names=("gate_proj", "up_proj", "down_proj"),
        sparse_layers=(True,),
    )
    torch.manual_seed(0)
    with torch.device(device):
        block = SparseMoeBlock(cfg["hidden"], spec).to(dtype)
    if weights != "bf16":
        quantize_randomly(block.experts, group_size=cfg["group"], seed=0, scheme_name=weights)
    for ex in block.experts:
        fused = fuse_linears([ex.gate_proj, ex.up_proj])
        del ex.gate_proj, ex.up_proj
        ex.gate_up_proj = fused
    return block.eval()


def run_moe(plan: dict) -> list[dict]:
    """fused_moe per weights kind and token count: largest error against the twin and the loop
    (over the twin's largest |value|), and us a call of the fused FFN and of the loop."""
    from slimserve.kernels import fused_moe as FM

    cfg, dev, dtype = plan["moe"], plan["device"], plan["dtype"]
    kops = select(torch.device(dev), dtype)
    rows = []
    for weights in plan.get("weights", WEIGHTS):
        block = None
        try:
            block = _moe_block(cfg, weights, dev, dtype)
            for t in cfg["tokens"]:
                row = {"weights": weights, "tokens": t}
                g = torch.Generator().manual_seed(t)
                x = torch.randn(t, cfg["hidden"], generator=g).to(dev, dtype)
                with torch.no_grad():
                    rw, ids = block.route(x)
                    st = block.stacked_experts(x)  # stacked at the first call
                    if st is None:
                        raise RuntimeError(f"{weights} experts did not stack for the kernel")

                    def fused(st=st, x=x, rw=rw, ids=ids):
                        return FM.fused_moe(x, st.gate_up, st.down, rw, ids, use_kernel=True)

                    def loop(block=block, x=x, rw=rw, ids=ids):
                        return block.experts_loop(x, rw, ids, kops)

                    got, base = fused().float(), loop().float()
                    twin = FM.fused_moe_torch(x, st.gate_up, st.down, rw, ids).float()
                    top = twin.abs().max().clamp_min(1e-30)
                    row["err_twin"] = ((got - twin).abs().max() / top).item()
                    row["err_loop"] = ((got - base).abs().max() / top).item()
                    row["ok"] = row["err_twin"] <= MOE_TOL
                    row["fused_us"] = _time_call(fused, cfg["reps"], dev)
                    row["loop_us"] = _time_call(loop, cfg["reps"], dev)
                row["x_loop"] = row["loop_us"] / row["fused_us"]  # > 1: the kernel is faster
                rows.append(row)
                print(
                    f"moe {weights:>5} tokens {t:>4}: fused {row['fused_us']:9.1f} us, loop "
                    f"{row['loop_us']:9.1f} us ({row['x_loop']:.2f}x), err vs twin "
                    f"{row['err_twin']:.2e}{'' if row['ok'] else ' FAILED'}",
                    flush=True,
                )
        except Exception:
            rows.append({"weights": weights, "error": traceback.format_exc()[-2000:]})
            print(f"moe {weights}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True)
        del block
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def _moe_table(rows: list[dict], plan: dict) -> str:
    cfg = plan["moe"]
    lines = [
        f"Fused MoE FFN (kernels/fused_moe.py) | {cfg['experts']} experts, top-{cfg['top_k']}, "
        f"hidden {cfg['hidden']}, expert intermediate {cfg['inter']}, random router | against "
        "the per-expert loop",
        "| weights | tokens | fused us | loop us | x loop (time) | err vs twin | err vs loop |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "fused_us" not in r:
            lines.append(f"| {r['weights']} | - | FAILED | | | | |")
            continue
        flag = "" if r["ok"] else " FAILED"
        lines.append(
            f"| {r['weights']} | {r['tokens']} | {r['fused_us']:.1f} | {r['loop_us']:.1f} | "
            f"{r['x_loop']:.2f}x | {r['err_twin']:.2e}{flag} | {r['err_loop']:.2e} |"
        )
    return "\n".join(lines)


# -- step 3: transformers generate with a static cache ----------------------------------------------


def _hf_config(spec: ModelSpec):
    from transformers import LlamaConfig

    theta = 1.0 / spec.inv_freq[1] ** (spec.head_dim / 2) if len(spec.inv_freq) > 1 else 10000.0
    return LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_theta=theta,
        tie_word_embeddings=False,
    )


def run_hf(plan: dict) -> list[dict]:
    from transformers import LlamaForCausalLM

    device, steps = plan["device"], plan["steps"]
    before = torch.get_default_dtype()
    torch.set_default_dtype(plan["dtype"])  # built in bf16: no fp32 copy of 8B weights first
    try:
        with torch.device(device):
            model = LlamaForCausalLM(_hf_config(plan["spec"])).eval()
    finally:
        torch.set_default_dtype(before)
    # generate's default (dynamic) cache, eager: what a user gets from `generate`; a static
    # cache makes transformers torch.compile the forward for every batch shape (minutes each)
    model.generation_config.disable_compile = True
    rows = []
    for batch in plan["batches"]:
        try:
            ids = torch.randint(
                0, plan["spec"].vocab_size, (batch, plan["prompt_len"]), device=device
            )

            def gen(n: int) -> float:
                _sync(device)
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(
                        ids,
                        attention_mask=torch.ones_like(ids),
                        max_new_tokens=n,
                        min_new_tokens=n,
                        do_sample=False,
                        pad_token_id=0,
                    )
                _sync(device)
                return time.perf_counter() - t0

            gen(2)  # warm-up
            dt = gen(steps + 1) - gen(1)
            rows.append({"batch": batch, "tok_s": batch * steps / dt, "step_ms": 1e3 * dt / steps})
            print(
                f"transformers generate (dynamic cache, eager) batch {batch:>3}: "
                f"{rows[-1]['tok_s']:9.1f} tok/s",
                flush=True,
            )
        except Exception:
            rows.append({"batch": batch, "error": traceback.format_exc()[-2000:]})
            print(
                f"transformers batch {batch}: FAILED\n{traceback.format_exc()[-1500:]}", flush=True
            )
    return rows


# -- step 4: tensor parallelism through the engine ------------------------------------------------

TP_SIZE = 2


def tp_gpus(dry_run: bool) -> int:
    """Devices TP can use: the visible GPUs; the dry run's two CPU processes count as two."""
    return TP_SIZE if dry_run else torch.cuda.device_count()


def tp_note(gpus: int, dry_run: bool) -> str:
    if dry_run:
        return f"dry run: TP={TP_SIZE} over {TP_SIZE} CPU processes (gloo), tiny shape"
    if gpus < TP_SIZE:
        return (
            "one GPU: TP=1 only (the bf16 eager decode rows above; TP=2 needs two GPUs, "
            "nothing was run for it)"
        )
    return f"{gpus} GPUs: TP=1 from the decode rows above, TP={TP_SIZE} through the engine (NCCL)"


def tp1_rows(decode_rows: list[dict]) -> list[dict]:
    """The TP=1 entry: step 2's bf16-weights, bf16-KV eager rows (the same engine, one rank)."""
    return [
        {
            "tp": 1,
            "batch": r["batch"],
            "tok_s": r["tok_s"],
            "step_ms": r["step_ms"],
            "comm_ms_per_step": None,
            "comm_calls_per_step": None,
        }
        for r in decode_rows
        if "tok_s" in r and r["weights"] == "bf16" and r["kv"] == "bf16" and r["graphs"] == "off"
    ]


def save_random_checkpoint(spec: ModelSpec, dtype: torch.dtype, device: str, folder: Path) -> Path:
    """config.json and model.safetensors of a random dense model of `spec`: what the ranks of a
    tensor-parallel engine read their slices from (they load from files, not from a model)."""
    from safetensors.torch import save_file

    model = random_model(spec, dtype, torch.device(device))
    config = _hf_config(spec)
    config.dtype = dtype
    config.save_pretrained(folder)
    save_file(
        {k: v.contiguous() for k, v in model.state_dict().items()},
        str(folder / "model.safetensors"),
    )
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return folder


def run_tp(plan: dict) -> list[dict]:
    """TP=2 decode rows on the plan's shape (bf16 weights and KV, eager)."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-check-tp-") as tmp:
        engine = None
        try:
            folder = save_random_checkpoint(plan["spec"], plan["dtype"], plan["device"], Path(tmp))
            config = EngineConfig(
                model=str(folder),
                device=plan["device"],
                dtype=str(plan["dtype"]).removeprefix("torch."),
                verify="none",
                tensor_parallel_size=TP_SIZE,
                max_num_seqs=max(plan["batches"]),
                max_num_batched_tokens=8192,
                kv_cache_memory=plan["kv_cache_memory"],
                max_model_len=plan["max_model_len"],
            )
            engine = LLMEngine(config)
            if plan["device"].startswith("cuda"):  # compile every kernel before timing
                decode_rate(engine, 1, plan["prompt_len"], 2, 1, plan["device"])
            for batch in plan["batches"]:
                before = engine.runner.comm_stats()
                r = decode_rate(
                    engine, batch, plan["prompt_len"], plan["steps"], plan["warmup"], plan["device"]
                )
                after = engine.runner.comm_stats()
                steps = after["steps"] - before["steps"]  # prefill and warm-up steps too
                rows.append(
                    {
                        "tp": TP_SIZE,
                        "batch": batch,
                        "tok_s": r["tok_s"],
                        "step_ms": r["step_ms"],
                        "comm_ms_per_step": 1e3 * (after["comm_s"] - before["comm_s"]) / steps,
                        "comm_calls_per_step": (after["comm_calls"] - before["comm_calls"]) / steps,
                    }
                )
                print(
                    f"tensor parallel TP={TP_SIZE} batch {batch:>3}: {r['tok_s']:9.1f} tok/s, "
                    f"{r['step_ms']:7.2f} ms/step, collectives {rows[-1]['comm_ms_per_step']:.2f} "
                    f"ms/step on rank 0",
                    flush=True,
                )
        except Exception:
            rows.append({"tp": TP_SIZE, "error": traceback.format_exc()[-2000:]})
            print(
                f"tensor parallel TP={TP_SIZE}: FAILED\n{traceback.format_exc()[-1500:]}",
                flush=True,
            )
        finally:
            if engine is not None:
                engine.runner.shutdown()
    return rows


def _tp_table(tp: dict) -> str:
    lines = [
        f"Tensor parallelism | {tp['note']}",
        "| TP | batch | tok/s | ms/step | collectives ms/step (rank 0) | collectives/step |",
        "|" + "---|" * 6,
    ]
    for r in tp["rows"]:
        if "tok_s" not in r:
            lines.append(f"| {r['tp']} | - | FAILED | | | |")
            continue
        comm = "" if r["comm_ms_per_step"] is None else f"{r['comm_ms_per_step']:.2f}"
        calls = "" if r["comm_calls_per_step"] is None else f"{r['comm_calls_per_step']:.0f}"
        lines.append(
            f"| {r['tp']} | {r['batch']} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {comm} | {calls} |"
        )
    return "\n".join(lines)


# -- the run -------------------------------------------------------------------------------------


def _child(
    step: str, dry_run: bool, hbm_tbps: float, result: str, weights: list[str], kv: list[str]
) -> int:
    plan = {**_plan(dry_run), "weights": weights, "kv": kv}
    run = {
        "decode": lambda: run_decode(plan, hbm_tbps),
        "hf": lambda: run_hf(plan),
        "tp": lambda: run_tp(plan),
        "kvdecode": lambda: run_kv_decode(plan),
        "moe": lambda: run_moe(plan),
    }[step]
    Path(result).write_text(json.dumps(run()))
    return 0


def _spawn(cmd: list[str], limit: float, env: dict) -> str:
    sys.stdout.flush()
    t0 = time.monotonic()
    try:
        rc = subprocess.run(cmd, env=env, timeout=limit).returncode
        status = "ok" if rc == 0 else f"exited with code {rc}"
    except subprocess.TimeoutExpired:
        status = f"killed at its {limit:.0f} s limit"
    return f"{status} ({time.monotonic() - t0:.0f} s)"


def _step(name: str, args, plan: dict, env: dict) -> tuple[str, list]:
    fd, path = tempfile.mkstemp(prefix=f"gpu-check-{name}-", suffix=".json")
    os.close(fd)
    cmd = [
        sys.executable,
        "-m",
        "slimserve.eval.gpu_check",
        "--child",
        name,
        "--result",
        path,
        "--hbm-tbps",
        str(args.hbm_tbps),
        "--weights",
        ",".join(args.weights),
        "--kv",
        ",".join(args.kv),
    ] + (["--dry-run"] if args.dry_run else [])
    status = _spawn(cmd, plan["limits"][name], env)
    try:
        rows = json.loads(Path(path).read_text() or "[]")
    except (OSError, ValueError):
        rows = []
    Path(path).unlink(missing_ok=True)
    return status, rows


def _table(report: dict) -> str:
    hf = {r["batch"]: r for r in report["transformers"] if "tok_s" in r}
    lines = [
        "| weights | KV | batch | graphs | tok/s | ms/step | roofline tok/s | % roofline "
        "| transformers tok/s | x transformers |",
        "|" + "---|" * 10,
    ]
    for r in report["decode"]:
        if "tok_s" not in r:
            lines.append(f"| {r['weights']} | {r['kv']} | - | {r['graphs']} | FAILED | | | | | |")
            continue
        base = hf.get(r["batch"]) if r["weights"] == "bf16" and r["kv"] == "bf16" else None
        lines.append(
            f"| {r['weights']} | {r['kv']} | {r['batch']} | {r['graphs']} | {r['tok_s']:.1f} | "
            f"{r['step_ms']:.2f} | {r['roofline_tok_s']:.0f} | {100 * r['roofline_share']:.1f}% | "
            f"{base['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x |"
            if base
            else f"| {r['weights']} | {r['kv']} | {r['batch']} | {r['graphs']} | {r['tok_s']:.1f} | "
            f"{r['step_ms']:.2f} | {r['roofline_tok_s']:.0f} | {100 * r['roofline_share']:.1f}% | | |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run, seconds")
    ap.add_argument(
        "--hbm-tbps",
        type=float,
        default=4.8,
        help="HBM bandwidth for the roofline (H200: 4.8 TB/s)",
    )
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for gpu_check.json")
    ap.add_argument(
        "--steps",
        type=_choices(STEPS),
        default=list(STEPS),
        help=f"comma list of steps to run (default: all of {','.join(STEPS)})",
    )
    ap.add_argument(
        "--weights",
        type=_choices(WEIGHTS),
        default=list(WEIGHTS),
        help=f"decode and moe rows' weights (default: {','.join(WEIGHTS)})",
    )
    ap.add_argument(
        "--kv",
        type=_choices(KV_CHOICES),
        default=list(KV),
        help=f"decode rows' KV caches, of {','.join(KV_CHOICES)} (default: {','.join(KV)})",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        if args.dry_run:
            os.environ["SLIMSERVE_KERNELS"] = "triton"  # the kernels, interpreted
        return _child(args.child, args.dry_run, args.hbm_tbps, args.result, args.weights, args.kv)
    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device visible; run with --dry-run on a CPU")
        return 2
    t0 = time.monotonic()
    plan = _plan(args.dry_run)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = plan["spec"]
    report = {
        "hardware": hardware_line(hardware_info()),
        "dry_run": args.dry_run,
        "shape": plan["shape"],
        "hidden": spec.hidden_size,
        "layers": spec.num_layers,
        "prompt_len": plan["prompt_len"],
        "decode_steps": plan["steps"],
        "hbm_tbps": args.hbm_tbps,
        "steps": {},
    }
    print(
        f"slimserve gpu_check | {report['hardware']} | random {plan['shape']} weights | "
        f"{plan['prompt_len']}-token prompts, {plan['steps']} timed decode steps",
        flush=True,
    )

    kern_json = out / "kernel_bench.json"
    kern_cmd = [
        sys.executable,
        "-m",
        "slimserve.eval.kernels.bench",
        "--json-out",
        str(kern_json),
        "--sections",
        "norm" if args.dry_run else "w4a16,w8a8,attn,norm",
    ]
    if not args.dry_run:
        kern_cmd.append("--quick")
    report["decode"], report["transformers"] = [], []
    if "kernels" in args.steps:
        report["steps"]["kernels"] = _spawn(kern_cmd, plan["limits"]["kernels"], env)
    for name in ("decode", "hf"):
        if name in args.steps:
            report["steps"][name], report["decode" if name == "decode" else "transformers"] = _step(
                name, args, plan, env
            )
    gpus = tp_gpus(args.dry_run)
    report["tensor_parallel"] = {
        "gpus": gpus,
        "note": tp_note(gpus, args.dry_run),
        "rows": tp1_rows(report["decode"]),
    }
    if "tp" in args.steps:
        if gpus < TP_SIZE:
            report["steps"]["tp"] = "skipped (one GPU: TP=1 only)"
        elif args.budget_s - (time.monotonic() - t0) < plan["limits"]["tp"]:
            report["steps"]["tp"] = "skipped (budget)"
        else:
            report["steps"]["tp"], tp_rows = _step("tp", args, plan, env)
            report["tensor_parallel"]["rows"] += tp_rows
    report["kv_decode"] = []
    if "kvdecode" in args.steps:
        if args.budget_s - (time.monotonic() - t0) < plan["limits"]["kvdecode"]:
            report["steps"]["kvdecode"] = "skipped (budget)"
        else:
            report["steps"]["kvdecode"], report["kv_decode"] = _step("kvdecode", args, plan, env)
    report["moe"] = []
    if "moe" in args.steps:
        if args.budget_s - (time.monotonic() - t0) < plan["limits"]["moe"]:
            report["steps"]["moe"] = "skipped (budget)"
        else:
            report["steps"]["moe"], report["moe"] = _step("moe", args, plan, env)
    left = args.budget_s - (time.monotonic() - t0)
    if "sweeps" in args.steps:
        if plan["limits"]["sweeps"] and left >= plan["limits"]["sweeps"]:
            report["steps"]["sweeps"] = _spawn(
                [
                    sys.executable,
                    "-m",
                    "slimserve.eval.kernels.bench",
                    "--sections",
                    "w4a16,w8a8",
                    "--json-out",
                    str(out / "kernel_sweeps.json"),
                ],
                left,
                env,
            )
        else:
            report["steps"]["sweeps"] = (
                "skipped (budget)" if plan["limits"]["sweeps"] else "skipped (dry run)"
            )
    report["seconds"] = time.monotonic() - t0
    print(
        f"\nEngine decode throughput | {report['hardware']} | random {plan['shape']} | batch x "
        f"{plan['prompt_len']}-token prompts, {plan['steps']} decode steps timed | roofline at "
        f"{args.hbm_tbps} TB/s\n" + _table(report)
    )
    print("\n" + _tp_table(report["tensor_parallel"]))
    if report["kv_decode"]:
        print("\n" + _kv_decode_table(report["kv_decode"], plan))
    if report["moe"]:
        print("\n" + _moe_table(report["moe"], plan))
    print(
        "steps: "
        + ", ".join(f"{k} {v}" for k, v in report["steps"].items())
        + f"; total {report['seconds']:.0f} s"
    )
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    print(f"results: {out / 'gpu_check.json'}")
    ok = all(v.startswith(("ok ", "skipped")) for v in report["steps"].values())
    ok = ok and all(
        "error" not in r
        for r in report["decode"]
        + report["transformers"]
        + report["tensor_parallel"]["rows"]
        + report["kv_decode"]
        + report["moe"]
    )
    ok = ok and all(r.get("ok", True) for r in report["moe"])  # the fused FFN's correctness
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
