"""Offline end-to-end engine throughput on randomly initialized models (no download).

`python -m slimserve.eval.engine_bench --shape llama-7b --device cuda` builds a Llama-2-7B-shaped
model with random weights twice, dense fp16 and W4A16 (random int4 codes, group 128) + FP8 KV
cache, and runs the same offline workload (random prompt ids, fixed input/output lengths, EOS
ignored) through `LLMEngine` for each, printing one table. Random weights are fine for speed: the
work per token does not depend on the values. On CPU, `--shape demo` gives a quick smoke run.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import shutil
import tempfile
import time
from dataclasses import replace

import torch
from torch import nn

from slimserve.runtime.config import EngineConfig
from slimserve.runtime.engine.llm_engine import LLMEngine
from slimserve.runtime.engine.sequence import SamplingParams
from slimserve.runtime.models.fuse import fuse_projections
from slimserve.runtime.models.llama import CausalLM, ModelSpec
from slimserve.runtime.models.load import BuiltModel, random_model
from slimserve.runtime.worker.model_runner import ModelRunner

SHAPES = {
    "llama-7b": ModelSpec(
        model_type="llama",
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_layers=32,
        num_heads=32,
        num_kv_heads=32,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=None,
        inv_freq=tuple((1.0 / (10000.0 ** (torch.arange(0, 128, 2).float() / 128))).tolist()),
    ),
    "llama3-8b": ModelSpec(
        model_type="llama",
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=None,
        inv_freq=tuple((1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))).tolist()),
    ),
    "demo": ModelSpec(
        model_type="llama",
        vocab_size=4096,
        hidden_size=384,
        intermediate_size=1024,
        num_layers=4,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        rms_norm_eps=1e-5,
        max_position_embeddings=1024,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        tie_word_embeddings=False,
        sliding_window=None,
        inv_freq=tuple((1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))).tolist()),
    ),
}


def quantize_randomly(
    model: CausalLM, group_size: int = 128, seed: int = 0, scheme_name: str = "W4A16"
) -> int:
    """Swap every decoder Linear for a QuantLinear (W4A16 packed int4, group `group_size`; or
    W8A8 int8 per channel) with random codes and plausible scales. Returns the count."""
    from slimserve.runtime.artifact.scheme import preset
    from slimserve.runtime.layers.quant_linear import QuantLinear

    scheme = preset(scheme_name)
    w8a8 = scheme.input_activations is not None
    if not w8a8:
        scheme = replace(scheme, weights=scheme.weights.with_(group_size=group_size))
    fmt = "int-quantized" if w8a8 else "pack-quantized"
    g = torch.Generator(device="cpu").manual_seed(seed)
    count = 0
    for name, lin in list(model.named_modules()):
        if not isinstance(lin, nn.Linear) or name == "lm_head":
            continue
        q = QuantLinear(
            lin.in_features,
            lin.out_features,
            lin.bias is not None,
            scheme,
            fmt,
            dtype=lin.weight.dtype,
            device=lin.weight.device,
        )
        if w8a8:
            q.weight.copy_(torch.randint(-127, 128, q.weight.shape, generator=g, dtype=torch.int8))
        else:
            q.weight_packed.copy_(
                torch.randint(
                    -(2**31), 2**31 - 1, q.weight_packed.shape, generator=g, dtype=torch.int32
                )
            )
        # |w| ~ 0.02 like the dense init: int4 codes span +-8 (scale ~ 0.02 / 4), int8 +-127
        span = 128 if w8a8 else 4
        q.weight_scale.copy_((torch.rand(q.weight_scale.shape, generator=g) + 0.5) * 0.02 / span)
        model.set_submodule(name, q)
        count += 1
    return count


@functools.cache
def _model_folder() -> str:
    """The folder a random model's EngineConfig names (it must exist; nothing is read from it):
    one per process, removed at exit (one per engine, never removed, piled up in /tmp)."""
    folder = tempfile.mkdtemp(prefix="slimserve-random-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def build_engine(
    spec: ModelSpec,
    *,
    quant: bool | str,
    kv_cache_dtype: str,
    device: str,
    dtype: torch.dtype,
    **engine_args,
) -> LLMEngine:
    """quant: False (dense), True / "W4A16" (int4 group 128) or "W8A8" (int8 per channel)."""
    folder = _model_folder()
    model = random_model(spec, dtype, torch.device(device))
    if quant:
        quantize_randomly(model, scheme_name="W4A16" if quant is True else quant)
    fuse_projections(model)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()  # the dense weights just replaced or concatenated
    built = BuiltModel(model, spec, None, kv_cache_dtype == "fp8_e4m3", bool(quant), (), dtype)
    config = EngineConfig(model=folder, device=device, kv_cache_dtype=kv_cache_dtype, **engine_args)
    return LLMEngine(config, ModelRunner(config, built))


def run_offline(
    engine: LLMEngine, num_prompts: int, input_len: int, output_len: int, seed: int = 0
) -> dict:
    """Submit all prompts at once (request rate inf) and run to completion."""
    g = torch.Generator().manual_seed(seed)
    vocab = engine.runner.spec.vocab_size
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i in range(num_prompts):
        ids = torch.randint(0, vocab, (input_len,), generator=g).tolist()
        engine.add_request(f"bench-{i}", ids, params)
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    steps, first, out_tokens = 0, None, 0
    while engine.has_unfinished():
        for out in engine.step():
            if first is None:
                first = time.perf_counter() - t0
            if out.finished:
                out_tokens += len(out.outputs[0].token_ids)
        steps += 1
    sync()
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "output_tokens": out_tokens,
        "steps": steps,
        "output_tok_per_s": out_tokens / wall,
        "first_token_s": first,
        "capacity_tokens": engine.runner.capacity_tokens,
        "weights_gb": sum(
            t.numel() * t.element_size()
            for t in [*engine.runner.model.parameters(), *engine.runner.model.buffers()]
        )
        / 1e9,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="demo")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument(
        "--kv-cache-memory", default=None, help="e.g. 40GiB (default: a fraction of free memory)"
    )
    args = ap.parse_args(argv)
    spec = SHAPES[args.shape]
    dtype = torch.float16 if args.device.startswith("cuda") else torch.float32
    rows = []
    for label, quant, kv in (("dense fp16", False, "auto"), ("W4A16 + FP8 KV", True, "fp8_e4m3")):
        engine = build_engine(
            spec,
            quant=quant,
            kv_cache_dtype=kv,
            device=args.device,
            dtype=dtype,
            max_num_seqs=args.max_num_seqs,
            kv_cache_memory=args.kv_cache_memory,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        res = run_offline(engine, args.num_prompts, args.input_len, args.output_len)
        rows.append({"config": label, **res})
        del engine
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    hw = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(
        f"\nEngine offline throughput | {hw} | random {args.shape} | {args.num_prompts} prompts x "
        f"{args.input_len} in / {args.output_len} out, rate inf, max_num_seqs {args.max_num_seqs}"
    )
    print(
        f"{'config':<18}{'out tok/s':>12}{'wall s':>9}{'steps':>7}{'TTFT1 s':>9}{'KV tokens':>11}{'weights GB':>12}"
    )
    for r in rows:
        print(
            f"{r['config']:<18}{r['output_tok_per_s']:>12.1f}{r['wall_s']:>9.2f}{r['steps']:>7}"
            f"{r['first_token_s']:>9.3f}{r['capacity_tokens']:>11}{r['weights_gb']:>12.2f}"
        )
    if len(rows) == 2:
        print(
            f"speed-up W4A16+FP8KV / dense: {rows[1]['output_tok_per_s'] / rows[0]['output_tok_per_s']:.2f}x"
        )
    return rows


if __name__ == "__main__":
    main()
