"""Peer baseline for `slimserve.eval.bench_quant`: llm-compressor's GPTQ on given calibration windows.

A standalone script, run by the python of a separate venv that has llm-compressor (it never
imports slimserve, and llm-compressor is never a slimserve dependency):

    python3 -m venv /work/peers/llmcompressor-venv
    /work/peers/llmcompressor-venv/bin/pip install torch==2.13.0
    /work/peers/llmcompressor-venv/bin/pip install "llmcompressor==0.14.*"
    /work/peers/llmcompressor-venv/bin/python eval/peers/llmcompressor_gptq.py \
        --model recipes/demo-model --calib-ids calib.safetensors --out /tmp/peer-w4 --bits 4 --group-size 128

It quantizes every Linear but lm_head with `oneshot` + `GPTQModifier` (int, symmetric, one scale
per group of `--group-size` inputs: llm-compressor's W4A16 preset at --bits 4 --group-size 128),
calibrating on exactly the token windows in `--calib-ids` (in file order, no shuffling), and
saves the compressed-tensors checkpoint (save_compressed=True) with the tokenizer into `--out`.
The last line on stdout is one JSON object: {"seconds_oneshot", "seconds_total", "versions", ...}.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

if __package__:  # imported as slimserve.eval.peers.* (the wheel check imports every module)
    from slimserve.eval.peers.calib_ids import load_ids
else:  # run as a script by a peer venv's python, which has no slimserve
    from calib_ids import load_ids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF checkpoint folder (or hub id)")
    p.add_argument(
        "--calib-ids",
        required=True,
        type=Path,
        help="[num_samples, seq_len] token ids: .safetensors (tensor 'input_ids') "
        "or .json (a list of lists)",
    )
    p.add_argument("--out", required=True, type=Path, help="folder for the compressed checkpoint")
    p.add_argument("--bits", type=int, default=4, help="weight bits (4, 3, ...)")
    p.add_argument("--group-size", type=int, default=128, help="input columns per weight scale")
    p.add_argument(
        "--actorder",
        choices=["static", "group", "none"],
        default="static",
        help="GPTQ column order (llm-compressor 0.14's default: static)",
    )
    p.add_argument(
        "--dampening-frac",
        type=float,
        default=0.01,
        help="Hessian dampening (llm-compressor's default)",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=128,
        help="GPTQ lazy-update block (llm-compressor's default)",
    )
    p.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16", "float16"],
        default="auto",
        help="dtype the model is loaded and calibrated in (auto: the checkpoint's)",
    )
    p.add_argument(
        "--dump-fakequant",
        type=Path,
        help="also write the fake-quantized Linear weights of three decoder layers here (safetensors)",
    )
    return p.parse_args(argv)


def gptq_modifier(
    bits: int, group_size: int, actorder: str, dampening_frac: float, block_size: int = 128
):
    from llmcompressor.modifiers.quantization import GPTQModifier

    weights = {
        "num_bits": bits,
        "type": "int",
        "symmetric": True,
        "strategy": "group",
        "group_size": group_size,
        "dynamic": False,
    }
    return GPTQModifier(
        config_groups={"group_0": {"targets": ["Linear"], "weights": weights}},
        ignore=["lm_head"],
        actorder=None if actorder == "none" else actorder,
        dampening_frac=dampening_frac,
        block_size=block_size,
    )


def dump_fakequant(model, path: Path) -> list[int]:
    """The Linear weights of the first, middle and last decoder layer as float32 safetensors
    (after oneshot they hold GPTQ's fake-quantized values); returns those layer indices."""
    import torch
    from safetensors.torch import save_file

    n = model.config.num_hidden_layers
    layers = sorted({0, n // 2, n - 1})
    prefixes = tuple(f"model.layers.{i}." for i in layers)
    tensors = {
        f"{name}.weight": mod.weight.detach().to(torch.float32).contiguous()
        for name, mod in model.named_modules()
        if isinstance(mod, torch.nn.Linear) and name.startswith(prefixes)
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return layers


def main(argv: list[str] | None = None) -> None:
    t_start = time.perf_counter()
    args = parse_args(argv)
    from importlib.metadata import version

    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = load_ids(args.calib_ids)
    num_samples, seq_len = len(ids), len(ids[0])
    dataset = Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * seq_len for _ in ids]})
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype)
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    t0 = time.perf_counter()
    oneshot(
        model=model,
        dataset=dataset,
        recipe=gptq_modifier(
            args.bits, args.group_size, args.actorder, args.dampening_frac, args.block_size
        ),
        max_seq_length=seq_len,
        num_calibration_samples=num_samples,
        shuffle_calibration_samples=False,
    )
    seconds_oneshot = time.perf_counter() - t0
    dumped = dump_fakequant(model, args.dump_fakequant) if args.dump_fakequant else None
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    result = {
        "seconds_oneshot": round(seconds_oneshot, 3),
        "seconds_total": round(time.perf_counter() - t_start, 3),
        "num_samples": num_samples,
        "seq_len": seq_len,
        "bits": args.bits,
        "group_size": args.group_size,
        "actorder": args.actorder,
        "dampening_frac": args.dampening_frac,
        "block_size": args.block_size,
        "dtype": dtype,
        "fakequant_layers": dumped,
        "versions": {
            p: version(p) for p in ("llmcompressor", "compressed-tensors", "torch", "transformers")
        },
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
