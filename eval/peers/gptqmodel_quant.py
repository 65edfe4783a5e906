"""Peer checkpoints: GPTQModel's GPTQ on given calibration windows (a GPTQModel-format checkpoint).

A standalone script, run by the python of a separate venv that has GPTQModel (it never imports
slimserve, and GPTQModel is never a slimserve dependency). 7.6.0 quantizes on the CPU; 7.7 wants
a CUDA build of torch. Its CPU worker pool must be told how many cores it may use:

    python3 -m venv /work/peers/gptqmodel-venv
    /work/peers/gptqmodel-venv/bin/pip install torch==2.13.0
    /work/peers/gptqmodel-venv/bin/pip install "gptqmodel==7.6.0"
    GPTQMODEL_CPU_WORKERS=2 /work/peers/gptqmodel-venv/bin/python eval/peers/gptqmodel_quant.py \
        --model recipes/demo-model --calib-ids calib.json --out /tmp/gptqmodel-w4 [--desc-act]

It quantizes every decoder-layer Linear (GPTQModel never quantizes lm_head unless told) with
`QuantizeConfig(bits, group_size, sym, desc_act)`, GPTQModel's other defaults unchanged (so
`act_group_aware` is on unless --desc-act), calibrating on exactly the token windows in
`--calib-ids` (`calibration_sort=None`, batch size 1), and saves with `model.save` (GPTQModel
writes the v1 `gptq` layout by default). `--dequant-out FILE` also writes GPTQModel's own
dequantization of every quantized Linear (`TorchQuantLinear.dequantize_weight()` on the saved
checkpoint, loaded back with `GPTQModel.load(..., backend=TORCH, dtype=float16)`) as `<module>.weight` [N, K] and
`logits` [1, T, vocab] of that loaded model on the first calibration window's first 64 tokens.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

if __package__:  # imported as slimserve.eval.peers.* (the wheel check imports every module)
    from slimserve.eval.peers.calib_ids import load_ids
else:  # run as a script by a peer venv's python, which has no slimserve
    from calib_ids import load_ids


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF checkpoint folder")
    p.add_argument(
        "--calib-ids",
        required=True,
        type=Path,
        help="[num_samples, seq_len] token ids (.json list of lists or .safetensors 'input_ids')",
    )
    p.add_argument("--out", required=True, type=Path, help="folder for the checkpoint")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="asymmetric (sym=False)")
    p.add_argument(
        "--desc-act", action="store_true", help="activation order (writes a permuting g_idx)"
    )
    p.add_argument(
        "--dynamic",
        type=json.loads,
        default=None,
        help='GPTQModel per-module overrides as JSON, e.g. \'{"+:.*down_proj": {"bits": 8}}\'',
    )
    p.add_argument("--format", default=None, help="GPTQModel `format` (default: its own, gptq)")
    p.add_argument("--dequant-out", type=Path, help="GPTQModel's own dequantized weights + logits")
    return p.parse_args(argv)


def dump_dequant(out: Path, path: Path, probe: list[int]) -> None:
    """GPTQModel's dequantization of each saved Linear, and logits of the model it loads."""
    import torch
    from gptqmodel import BACKEND, GPTQModel
    from safetensors.torch import save_file

    # fp16, the dtype of the stored scales: loaded as a bf16 model, GPTQModel rounds them to bf16.
    model = GPTQModel.load(str(out), backend=BACKEND.TORCH, device="cpu", dtype=torch.float16)
    deq = {}
    for name, mod in model.model.named_modules():
        if hasattr(mod, "qweight") and hasattr(mod, "dequantize_weight"):
            # [N, K]
            deq[f"{name}.weight"] = mod.dequantize_weight().t().contiguous().to(torch.float16)
    with torch.no_grad():
        logits = model.model(torch.tensor([probe])).logits.float()
    save_file({**deq, "logits": logits.contiguous(), "probe_ids": torch.tensor([probe])}, str(path))


def main(argv: list[str] | None = None) -> None:
    t_start = time.perf_counter()
    args = parse_args(argv)
    os.environ.setdefault("GPTQMODEL_CPU_WORKERS", "2")
    from importlib.metadata import version

    from gptqmodel import GPTQModel, QuantizeConfig

    ids = load_ids(args.calib_ids)
    kw = {
        "bits": args.bits,
        "group_size": args.group_size,
        "sym": not args.asym,
        "desc_act": args.desc_act,
    }
    if args.desc_act:
        kw["act_group_aware"] = False  # GPTQModel refuses desc_act together with its default GAR
    if args.format:
        kw["format"] = args.format
    if args.dynamic:
        kw["dynamic"] = args.dynamic
    qcfg = QuantizeConfig(**kw)
    model = GPTQModel.load(args.model, qcfg, device="cpu")
    calibration = [{"input_ids": row, "attention_mask": [1] * len(row)} for row in ids]
    t0 = time.perf_counter()
    model.quantize(calibration, batch_size=1, calibration_sort=None)
    seconds_quant = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    model.save(str(args.out))
    if args.dequant_out:
        dump_dequant(args.out, args.dequant_out, ids[0][:64])
    result = {
        "seconds_quant": round(seconds_quant, 3),
        "seconds_total": round(time.perf_counter() - t_start, 3),
        "num_samples": len(ids),
        "seq_len": len(ids[0]),
        "config": kw,
        "versions": {p: version(p) for p in ("gptqmodel", "torch", "transformers")},
    }
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
