"""Peer checkpoints: AutoAWQ's AWQ (or its round-to-nearest alone) on given calibration windows.

A standalone script, run by the python of a separate venv that has AutoAWQ (it never imports
slimserve, and AutoAWQ is never a slimserve dependency; 0.2.9 is the last release, deprecated,
and quantizes on the CPU):

    python3 -m venv /work/peers/autoawq-venv
    /work/peers/autoawq-venv/bin/pip install torch==2.13.0
    /work/peers/autoawq-venv/bin/pip install "autoawq==0.2.9"
    /work/peers/autoawq-venv/bin/python eval/peers/autoawq_quant.py \
        --model recipes/demo-model --calib-ids calib.json --out /tmp/autoawq-w4

Modes (`--mode`):
  awq     `AutoAWQForCausalLM.quantize` (scale search + clip search + its quantizer) and
          `save_quantized`: the AutoAWQ GEMM checkpoint users download (`quant_method: awq`).
          Only with zero points: AutoAWQ's GEMM packer asserts zeros exist.
  scaled  the same search with `export_compatible=True`: scaled and clipped fp16 weights, not
          quantized, saved as a plain checkpoint (quantize it with our `rtn` to separate
          AutoAWQ's search from its quantizer). With --no-zero-point this is the only way to
          get AutoAWQ's symmetric search out of it.
  fake    the `scaled` weights fake-quantized by AutoAWQ's own `pseudo_quantize_tensor` (with
          --no-zero-point: absmax/7 per group), saved dense: AutoAWQ's symmetric AWQ end to end.
  rtn     no search: AutoAWQ's `pseudo_quantize_tensor` alone, saved dense (its RTN yardstick).
The calibration windows come from `--calib-ids` ([num_samples, seq_len] token ids), passed as
AutoAWQ's list-of-token-id-lists `calib_data` with max_calib_samples = num_samples and
max_calib_seq_len = seq_len, so it sees exactly those windows in file order. `--dequant-out FILE`
(awq mode) also writes AutoAWQ's own dequantization (`awq.utils.packing_utils.dequantize_gemm`)
of every quantized Linear, as `<module>.weight` [N, K] fp16, plus `logits` [1, T, vocab] of the
saved checkpoint dequantized that way on `--probe-ids` (the first calibration window's first 64
tokens), for the interop tests. The last stdout line is one JSON object.
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
from types import SimpleNamespace

MODES = ("awq", "scaled", "fake", "rtn")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF checkpoint folder")
    p.add_argument(
        "--calib-ids",
        type=Path,
        help="[num_samples, seq_len] token ids (.json list of lists "
        "or .safetensors tensor 'input_ids'); not needed for --mode rtn",
    )
    p.add_argument("--out", required=True, type=Path, help="folder for the checkpoint")
    p.add_argument("--mode", choices=MODES, default="awq")
    p.add_argument("--w-bit", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--no-zero-point", action="store_true", help="symmetric (AutoAWQ: absmax / 7)")
    p.add_argument("--no-clip", action="store_true", help="skip AutoAWQ's clip search")
    p.add_argument("--no-duo-scaling", action="store_true", help="s = x^a instead of x^a / w^(1-a)")
    p.add_argument(
        "--modules-to-not-convert",
        nargs="*",
        default=None,
        help="name fragments AutoAWQ leaves unquantized (e.g. down_proj)",
    )
    p.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="compute dtype of the search (AutoAWQ's default float16; transformers 5 ignores "
        "the torch_dtype AutoAWQ passes, so the script casts the loaded model)",
    )
    p.add_argument(
        "--dequant-out", type=Path, help="awq mode: AutoAWQ's own dequantized weights + logits"
    )
    return p.parse_args(argv)


def pseudo_quantizer(args: argparse.Namespace):
    """AutoAWQ's own fake quantizer (AwqQuantizer.pseudo_quantize_tensor) for these options."""
    from awq.quantize.quantizer import AwqQuantizer

    cfg = SimpleNamespace(
        w_bit=args.w_bit, group_size=args.group_size, zero_point=not args.no_zero_point
    )
    return lambda w: AwqQuantizer.pseudo_quantize_tensor(cfg, w)[0]


def fake_quantize_layers(awq_model, args: argparse.Namespace) -> int:
    """Replace every decoder-layer Linear's weight by AutoAWQ's fake quantization of it."""
    import torch

    quant = pseudo_quantizer(args)
    count = 0
    with torch.no_grad():
        for layer in awq_model.get_model_layers(awq_model.model):
            for name, mod in layer.named_modules():
                skip = any(frag in name for frag in (args.modules_to_not_convert or []))
                if isinstance(mod, torch.nn.Linear) and not skip:
                    mod.weight.copy_(quant(mod.weight.data))
                    count += 1
    return count


def dump_dequant(out: Path, path: Path, args: argparse.Namespace, probe: list[int]) -> None:
    """AutoAWQ's dequantization of each saved Linear, and logits of the model built from them."""
    import torch
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    deq = {}
    for key in [k for k in tensors if k.endswith(".qweight")]:
        prefix = key.removesuffix(".qweight")
        w = dequantize_gemm(
            tensors[key],
            tensors[f"{prefix}.qzeros"],
            tensors[f"{prefix}.scales"],
            args.w_bit,
            args.group_size,
        )  # [K, N]
        deq[f"{prefix}.weight"] = w.t().contiguous().half()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float16)
    state = {
        k: v
        for k, v in tensors.items()
        if k.rsplit(".", 1)[-1] not in ("qweight", "qzeros", "scales")
    }
    model.load_state_dict({**state, **deq}, strict=False)
    with torch.no_grad():
        logits = model.float()(torch.tensor([probe])).logits
    save_file({**deq, "logits": logits.contiguous(), "probe_ids": torch.tensor([probe])}, str(path))


def main(argv: list[str] | None = None) -> None:
    t_start = time.perf_counter()
    args = parse_args(argv)
    if args.mode == "awq" and args.no_zero_point:
        raise SystemExit(
            "--mode awq needs zero points (AutoAWQ's GEMM packer asserts them); "
            "use --mode fake or scaled for the symmetric search"
        )
    from importlib.metadata import version

    import torch
    from awq import AutoAWQForCausalLM
    from transformers import AutoTokenizer

    awq_model = AutoAWQForCausalLM.from_pretrained(args.model, device_map="cpu")
    awq_model.model.to(getattr(torch, args.dtype))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    quant_config = {
        "zero_point": not args.no_zero_point,
        "q_group_size": args.group_size,
        "w_bit": args.w_bit,
        "version": "GEMM",
    }
    if args.modules_to_not_convert:
        quant_config["modules_to_not_convert"] = args.modules_to_not_convert
    ids = load_ids(args.calib_ids) if args.calib_ids else None
    t0 = time.perf_counter()
    if args.mode != "rtn":
        if ids is None:
            raise SystemExit(f"--mode {args.mode} needs --calib-ids")
        awq_model.quantize(
            tokenizer,
            quant_config=quant_config,
            calib_data=ids,
            max_calib_samples=len(ids),
            max_calib_seq_len=len(ids[0]),
            duo_scaling=not args.no_duo_scaling,
            apply_clip=not args.no_clip,
            export_compatible=args.mode != "awq",
        )
    if args.mode in ("fake", "rtn"):
        fake_quantize_layers(awq_model, args)
    seconds_quant = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.mode == "awq":
        awq_model.save_quantized(str(args.out))
    else:
        awq_model.model.to(torch.float16).save_pretrained(str(args.out))
    tokenizer.save_pretrained(str(args.out))
    if args.dequant_out:
        if args.mode != "awq":
            raise SystemExit("--dequant-out needs --mode awq")
        probe = ids[0][:64] if ids else list(range(64))
        dump_dequant(args.out, args.dequant_out, args, probe)
    result = {
        "mode": args.mode,
        "seconds_quant": round(seconds_quant, 3),
        "seconds_total": round(time.perf_counter() - t_start, 3),
        "num_samples": len(ids) if ids else 0,
        "seq_len": len(ids[0]) if ids else 0,
        "quant_config": quant_config,
        "clip": not args.no_clip,
        "dtype": args.dtype,
        "versions": {p: version(p) for p in ("autoawq", "torch", "transformers")},
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
