"""The KV block layout both sides of a hand-over must share, and its check.

A block is `[block_size, num_kv_heads, head_dim]` of `kv_dtype` per layer, for K and for V (the
cache of runtime/worker/model_runner.py), except in the layers an fp8 cache keeps unquantized
(`skip_layers`, cached in `skip_dtype`). An int8 / int4 cache (`kv_dtype` "int8" / "int4") is
uint8 rows of `row_bytes(layer)` per head, each with its own scale and zero (kernels/kv_quant.py),
so its blocks travel as they are and no scales travel beside them. With an fp8 cache the stored values are `k / k_scale`, so the
decode side must also hold the same scales: they are compared as tensors of any shape (one per
layer today, one per head once calibrated per head), exactly, value for value. The model's shape
(vocabulary, hidden size, attention heads) is compared too: a cache computed by another model has
the right shape and the wrong meaning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from slimserve.runtime.disagg.errors import KVLayoutError
from slimserve.runtime.worker.model_runner import INT_KV_BITS, kv_row_bytes

# field -> the flag that sets it on `runtime serve` (how the user fixes a mismatch)
FIXES = {
    "kv_dtype": "--kv-cache-dtype (and --dtype)",
    "block_size": "--block-size",
    "skip_layers": "--kv-cache-dtype-skip-layers (or the same artifact)",
    "skip_dtype": "--dtype",
    "num_kv_heads": "the same model",
    "head_dim": "the same model",
    "num_layers": "the same model (and no pipeline split)",
    "vocab_size": "the same model",
    "hidden_size": "the same model",
    "num_heads": "the same model",
}


@dataclass(frozen=True)
class KVLayout:
    kv_dtype: str  # torch dtype name of the cache, e.g. "float32", "float8_e4m3fn"; or int8, int4
    block_size: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    vocab_size: int
    hidden_size: int
    num_heads: int
    skip_layers: str = ""  # "1,16": layers cached in skip_dtype instead of kv_dtype ("" : none)
    skip_dtype: str = ""  # torch dtype name of those layers' cache
    # per layer: (k_scale, v_scale) as fp32 CPU tensors of any shape; None: the cache is unscaled
    scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = field(
        default=None, compare=False
    )

    def layer_dtype(self, layer: int) -> torch.dtype:
        """The cache dtype of one layer (uint8 for int8 / int4 rows)."""
        skipped = self.skip_layers and str(layer) in self.skip_layers.split(",")
        name = self.skip_dtype if skipped else self.kv_dtype
        return torch.uint8 if name in INT_KV_BITS else getattr(torch, name)

    def row_bytes(self, layer: int) -> int:
        """Bytes of one token's row of one KV head in this layer's cache."""
        return kv_row_bytes(
            self.head_dim, self.layer_dtype(layer), INT_KV_BITS.get(self.kv_dtype, 0)
        )

    @property
    def block_shape(self) -> tuple[int, int, int]:
        return (self.block_size, self.num_kv_heads, self.head_dim)

    def fields(self) -> dict[str, Any]:
        """The scalar fields (the scales travel as tensors beside them)."""
        d = asdict(self)
        d.pop("scales")
        return d

    def check_matches(self, remote: KVLayout, remote_name: str = "the prefill replica") -> None:
        """KVLayoutError naming the first field (or scale) that differs between `remote` and us."""
        mine, theirs = self.fields(), remote.fields()
        for key, value in mine.items():
            if theirs.get(key) != value:
                raise KVLayoutError(
                    f"KV layout mismatch: {key} is {theirs.get(key)!r} on "
                    f"{remote_name} but {value!r} here; start both with "
                    f"{FIXES.get(key, 'the same settings')}"
                )
        if (self.scales is None) != (remote.scales is None):
            raise KVLayoutError(
                f"KV layout mismatch: {remote_name} "
                f"{'has no' if remote.scales is None else 'has'} FP8 k/v scales, "
                f"this replica {'has' if remote.scales is None else 'has none'}; "
                "serve the same artifact with the same --kv-cache-dtype"
            )
        if self.scales is None:
            return
        for i, (here, there) in enumerate(zip(self.scales, remote.scales)):  # type: ignore[arg-type]
            for name, a, b in (("k_scale", here[0], there[0]), ("v_scale", here[1], there[1])):
                if a.shape != b.shape:
                    raise KVLayoutError(
                        f"KV layout mismatch: layer {i} {name} has shape "
                        f"{list(b.shape)} on {remote_name} but {list(a.shape)} "
                        "here; serve the same artifact on both"
                    )
                if not torch.equal(a, b):
                    raise KVLayoutError(
                        f"KV layout mismatch: layer {i} {name} differs "
                        f"({b.flatten()[:4].tolist()} on {remote_name}, "
                        f"{a.flatten()[:4].tolist()} here): fp8 K/V would be "
                        "rescaled wrongly; serve the same artifact on both"
                    )


def _scales_of(model: torch.nn.Module) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        out.append(
            (
                attn.k_scale.detach().float().cpu().clone(),
                attn.v_scale.detach().float().cpu().clone(),
            )
        )
    return tuple(out)


def layout_of(runner: Any) -> KVLayout:
    """The layout of a ModelRunner's KV cache (runtime/worker/model_runner.py)."""
    spec = runner.model.spec
    fp8 = runner.kv_dtype == torch.float8_e4m3fn
    skipped = [i for i, dt in enumerate(runner.kv_dtypes) if dt != runner.kv_dtype]
    skip_dtype = str(runner.kv_dtypes[skipped[0]]).removeprefix("torch.") if skipped else ""
    bits = getattr(runner, "kv_bits", 0)
    return KVLayout(
        f"int{bits}" if bits else str(runner.kv_dtype).removeprefix("torch."),
        runner.block_size,
        runner.kv_heads,
        spec.head_dim,
        len(runner.kv_caches),
        spec.vocab_size,
        spec.hidden_size,
        spec.num_heads,
        ",".join(map(str, skipped)),
        skip_dtype,
        _scales_of(runner.model) if fp8 else None,
    )
