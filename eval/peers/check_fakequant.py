"""Does our loader read a peer's artifact back as the weights the peer measured? (bench_quant's sanity row)

    python -m slimserve.eval.peers.check_fakequant ARTIFACT FAKEQUANT.safetensors

FAKEQUANT holds `<linear>.weight` tensors the peer had in memory after quantizing (llm-compressor
keeps GPTQ's fake-quantized weights in its modules: eval/peers/llmcompressor_gptq.py
`--dump-fakequant`). ARTIFACT is loaded by our loader (runtime/loading/loader.py `load_model`, the one
`compress eval` uses), and each named Linear's dequantized weight (QuantLinear
`dequantized_weight`) is compared with the peer's tensor. Elements may differ by the storage
dtype's rounding (one epsilon of |w|): the peer's fake-quant arithmetic and our dequantization round
in that dtype in their own order. The last line on stdout is one JSON object:
{"match", "modules", "layers", "max_abs_diff", "elements_over", "tolerance_note", "mismatched"}.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

_LAYER = re.compile(r"\.layers\.(\d+)\.")


def compare(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], storage: torch.dtype
) -> dict:
    """Element-wise comparison of two {name: weight} dicts over the names of `theirs`."""
    eps = torch.finfo(storage).eps
    worst, over, mismatched = 0.0, 0, []
    for name, ref in sorted(theirs.items()):
        got = ours.get(name)
        if got is None or tuple(got.shape) != tuple(ref.shape):
            mismatched.append(
                f"{name}: {'missing' if got is None else f'shape {tuple(got.shape)}'} "
                f"in ours, {tuple(ref.shape)} in the peer's"
            )
            continue
        diff = (got.double() - ref.double()).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        bad = int((diff > eps * ref.double().abs()).sum())
        if bad:
            over += bad
            mismatched.append(f"{name}: {bad} elements differ by more than {eps:g} x |w|")
    layers = sorted({int(m.group(1)) for n in theirs if (m := _LAYER.search(n))})
    return {
        "match": not mismatched,
        "modules": len(theirs),
        "layers": layers,
        "max_abs_diff": worst,
        "elements_over": over,
        "tolerance_note": f"tolerance {eps:g} x |w|, the {str(storage)[6:]} epsilon",
        "mismatched": mismatched[:10],
    }


def dequantized_weights(model: torch.nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """{name.weight: float32 weight as our runtime computes with it}."""
    out = {}
    modules = dict(model.named_modules())
    for key in names:
        mod = modules.get(key.removesuffix(".weight"))
        if mod is None:
            continue
        if hasattr(mod, "dequantized_weight"):
            out[key] = mod.dequantized_weight(torch.float32)
        elif isinstance(getattr(mod, "weight", None), torch.Tensor):
            out[key] = mod.weight.detach().float()  # not quantized by our loader: compare as stored
    return out


def storage_dtype(artifact: Path) -> torch.dtype:
    """The artifact's dtype (config.json), the dtype both sides round the fake-quant weights in."""
    cfg = json.loads((artifact / "config.json").read_text())
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return getattr(torch, name) if name in ("float32", "float16", "bfloat16") else torch.float32


def main(argv: list[str] | None = None) -> int:
    from safetensors.torch import load_file

    from slimserve.runtime.errors import ArtifactError
    from slimserve.runtime.loading.loader import load_model

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(
            "usage: python -m slimserve.eval.peers.check_fakequant ARTIFACT FAKEQUANT.safetensors",
            file=sys.stderr,
        )
        return 2
    artifact, dump = Path(argv[0]), Path(argv[1])
    if not dump.is_file():
        print(
            f"error: {dump} does not exist; write it with the peer script's --dump-fakequant",
            file=sys.stderr,
        )
        return 2
    try:
        loaded = load_model(artifact, dtype=torch.float32)
    except ArtifactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    theirs = load_file(str(dump))
    with torch.no_grad():
        ours = dequantized_weights(loaded.model, list(theirs))
    res = compare(ours, theirs, storage_dtype(artifact))
    res["quantized"] = loaded.quantized
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
