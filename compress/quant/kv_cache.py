"""The `kv_cache` stage: calibrate one static fp8 scale for K and for V in every attention layer.

The scale arithmetic is the artifact's (runtime/artifact/kv_scales.py); the model attends over
fp8-round-tripped K/V through the runtime's transformers plug-in (runtime/loading/hf_fp8kv.py), so each
layer is calibrated on the outputs of the fp8-KV layers before it.

Choosing the scale. e4m3 is a float format: above 2^-6 x scale every value keeps 3 mantissa bits
whatever the scale, so the scale decides only (a) what is clipped (|x| > 448 x scale) and (b) where
the rounding grid falls (scale and 2 x scale give the same relative grid; scales in between shift
it). absmax / 448 clips every later value above the calibration maximum (validation keys exceed
it by up to 14% and values by up to 21% on SmolLM2), so the scale starts at `headroom` x
absmax / 448, which costs only the values pushed under 2^-6 x scale. Within the next factor of 2
the grid's position changes the attention error for K a lot (on SmolLM2 the worst scale's error
is up to 3x the best's in a layer; for V a few percent), so `scale_search` geometrically spaced
scales in [headroom, 2 x headroom) x absmax / 448 are tried on the calibration windows and the
one with the least attention-output error is kept, for K with V exact and for V with K exact.
The result is still one static per-tensor scale each: any reader of the format uses it unchanged.

Layers kept unquantized. Some layers lose more to fp8 than others; a KV cache that stays in the
model dtype in those layers (vLLM's `--kv-cache-dtype-skip-layers`) keeps most of the memory
saving at a fraction of the quality cost. `skip_layers` names them; `skip_sensitive: N` picks the
N layers whose fp8 KV alone moves the model's output the most: each layer is scored by the mean
KL divergence, over `sensitivity_samples` calibration windows, of the next-token distribution
with fp8 K/V in that layer alone from the exact one (end to end, since how much an attention
error matters depends on the layers after it; `LayerSensitivity` measures it layer by layer as
the layers are calibrated). Every layer still gets calibrated scales in the artifact (a
reader that ignores the skip list serves all layers in fp8); the manifest's
`kv_cache_skip_layers` lists the skipped ones.

`dtype: int8` / `int4`. No scales to choose: the serving engine quantizes each token's K and V
per KV head as it writes them (kernels/kv_quant.py), so the stage needs no calibration windows
and does not run layer by layer. It records the dtype in the manifest (`kv_cache_dtype`, which
`--kv-cache-dtype auto` serves) with `skip_layers` as `kv_cache_skip_layers`, and makes the
model attend over K/V read back from such a cache (runtime/loading/hf_fp8kv.py
`set_kv_int_bits`), so the pipeline's perplexity after the stage is the int cache's.
`skip_sensitive` scores fp8 and is refused with an int dtype.
"""

from __future__ import annotations

import math
import time

import torch
from pydantic import BaseModel, ConfigDict, field_validator
from torch import nn

from slimserve.compress.calibration import capture_first_layer_inputs, layer_on_device
from slimserve.compress.errors import RecipeError
from slimserve.compress.mappings import decoder_layers, mapping_for
from slimserve.compress.stage import CompressionState, LayerInputs, Stage, StageReport, replay
from slimserve.runtime.artifact.kv_scales import (
    SUPPORTED_KV_DTYPES,
    fp8_e4m3_roundtrip,
    kv_scale_from_absmax,
)
from slimserve.runtime.artifact.weights import decoder_layer_index
from slimserve.runtime.loading.hf_fp8kv import (
    clear_kv_scale_buffers,
    observing_attention,
    set_kv_int_bits,
    set_kv_scale_buffers,
    use_fp8kv_attention,
)
from slimserve.runtime.models.load import ARTIFACT_KV_DTYPES

MAX_HEADROOM = 64.0  # puts the calibration max at 7 in e4m3 units, still 2^8.8 above the subnormals
MAX_SCALE_SEARCH = 32


class KvCacheOptions(BaseModel):
    """Options of the `kv_cache` stage."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # KV-cache storage dtype: fp8_e4m3 (calibrated static scales), int8 or int4 (per token and
    # KV head, computed as the cache is written; no calibration)
    dtype: str = "fp8_e4m3"
    headroom: float = (
        2.0  # the smallest scale tried is headroom x absmax / 448 (1: absmax maps to 448)
    )
    scale_search: int = 8  # scales tried per layer for K and for V in [1, 2) x that; 1: no search
    skip_layers: list[int] = []  # decoder layers whose KV cache stays in the model dtype
    skip_sensitive: int = (
        0  # also keep the N layers most sensitive to fp8 KV (end-to-end KL) unquantized
    )
    sensitivity_samples: int = 4  # calibration windows skip_sensitive scores the layers on

    @field_validator("skip_layers")
    @classmethod
    def _check_skip(cls, v: list[int]) -> list[int]:
        bad = [i for i in v if i < 0]
        if bad:
            raise ValueError(f"skip_layers {bad}: layer indices start at 0")
        return sorted(set(v))

    @field_validator("skip_sensitive")
    @classmethod
    def _check_sensitive(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"skip_sensitive {v}: give a number of layers >= 0")
        return v

    @field_validator("sensitivity_samples")
    @classmethod
    def _check_samples(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"sensitivity_samples {v}: give at least 1 calibration window")
        return v

    @field_validator("dtype")
    @classmethod
    def _check_dtype(cls, v: str) -> str:
        known = (*SUPPORTED_KV_DTYPES, *ARTIFACT_KV_DTYPES)
        if v not in known:
            raise ValueError(f"dtype {v!r} is not supported; supported: {', '.join(known)}")
        return v

    @field_validator("headroom")
    @classmethod
    def _check_headroom(cls, v: float) -> float:
        if not (1.0 <= v <= MAX_HEADROOM):
            raise ValueError(
                f"headroom {v} is out of range; use 1 to {MAX_HEADROOM:g} (below 1 clips "
                "calibration values; 2 is the default)"
            )
        return v

    @field_validator("scale_search")
    @classmethod
    def _check_search(cls, v: int) -> int:
        if not (1 <= v <= MAX_SCALE_SEARCH):
            raise ValueError(
                f"scale_search {v} is out of range; use 1 (no search) to {MAX_SCALE_SEARCH}"
            )
        return v


class KvCacheStage(Stage):
    """Calibrate per-layer static fp8 K/V scales and make the model attend over fp8 K/V."""

    name = "kv_cache"
    needs_calibration = True
    layerwise = True

    def __init__(self, options: KvCacheOptions):
        self.options = options
        self.online = options.dtype in ARTIFACT_KV_DTYPES  # int8 / int4: nothing to calibrate
        if self.online:
            self.needs_calibration = False
            self.layerwise = False
        self._sensitivity: LayerSensitivity | None = (
            None  # built layer by layer with skip_sensitive
        )
        self.report = StageReport(
            self.name,
            details={
                "dtype": options.dtype,
                "headroom": options.headroom,
                "scale_search": options.scale_search,
                "layers": {},
            },
        )

    def preflight(self, config):
        check_kv_architecture(config)
        if self.online and self.options.skip_sensitive:
            raise RecipeError(
                f"stages.kv_cache: skip_sensitive scores layers for fp8 on calibration windows; "
                f"with dtype {self.options.dtype} list the layers in skip_layers instead"
            )
        heads = getattr(config, "num_attention_heads", None)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // heads if heads and hasattr(config, "hidden_size") else None
        )
        if self.options.dtype == "int4" and head_dim is not None and head_dim % 2:
            raise RecipeError(
                f"stages.kv_cache: dtype int4 needs an even head_dim (two codes a byte); this "
                f"model's is {head_dim}; use dtype int8"
            )
        layers = getattr(config, "num_hidden_layers", None)
        if layers is None:
            return None
        bad = [i for i in self.options.skip_layers if i >= layers]
        if bad:
            raise RecipeError(
                f"stages.kv_cache.skip_layers: {bad} are not layers of this {layers}-layer "
                f"model; use 0 to {layers - 1}"
            )
        if len(self.options.skip_layers) + self.options.skip_sensitive >= layers:
            raise RecipeError(
                f"stages.kv_cache: skip_layers ({len(self.options.skip_layers)}) and "
                f"skip_sensitive ({self.options.skip_sensitive}) leave none of the {layers} "
                f"layers in {self.options.dtype}; skip fewer"
            )
        return None

    def apply(self, state: CompressionState) -> None:
        """int8 / int4: every decoder layer not in skip_layers attends over K/V read back from
        such a cache; the manifest records the dtype (no scales)."""
        t0 = time.perf_counter()
        bits = 8 if self.options.dtype == "int8" else 4
        mapping = mapping_for(state.model)
        skip = set(self.options.skip_layers)
        for i, layer in enumerate(decoder_layers(state.model, mapping)):
            set_kv_int_bits(layer.get_submodule(mapping.attention), 0 if i in skip else bits)
        use_fp8kv_attention(state.model)
        state.kv_cache_dtype = self.options.dtype
        self.report.seconds += time.perf_counter() - t0

    def prepare(self, state: CompressionState) -> None:
        if self.online:
            return
        # Layers without scales yet attend as sdpa; each gets its scales in compress_layer, so the
        # next layer is calibrated on the outputs of an fp8-KV layer (or an exact one where skipped).
        use_fp8kv_attention(state.model)
        if self.options.skip_sensitive:
            self._sensitivity = LayerSensitivity(
                state.calibration[: self.options.sensitivity_samples]
            )

    def compress_layer(self, ctx) -> None:
        t0 = time.perf_counter()
        attn = ctx.module(ctx.mapping.attention)
        k_absmax, v_absmax = observe_kv_absmax(ctx, attn)
        storage, opts = ctx.state.storage_dtype, self.options
        k_grid, v_grid = (
            candidate_scales(a, opts.headroom, opts.scale_search, storage)
            for a in (k_absmax, v_absmax)
        )
        if opts.scale_search > 1:
            k_err, v_err = search_kv_scales(ctx, attn, k_grid, v_grid)
            k_scale, v_scale = k_grid[_argmin(k_err)], v_grid[_argmin(v_err)]
        else:
            k_err = v_err = []
            k_scale, v_scale = k_grid[0], v_grid[0]
        scored = ctx.index not in self.options.skip_layers
        if scored:
            set_kv_scale_buffers(attn, k_scale, v_scale)
        name = f"{ctx.prefix}.{ctx.mapping.attention}"
        ctx.state.kv_scales[name] = (k_scale, v_scale)
        entry = {"k_absmax": k_absmax, "v_absmax": v_absmax, "k_scale": k_scale, "v_scale": v_scale}
        if (
            k_err
        ):  # the chosen scale's attention error against the first (headroom x absmax / 448) one
            entry["k_error_vs_first"] = min(k_err) / k_err[0] if k_err[0] > 0 else 1.0
            entry["v_error_vs_first"] = min(v_err) / v_err[0] if v_err[0] > 0 else 1.0
        self.report.details["layers"][name] = entry
        if self._sensitivity is not None:
            self._sensitivity.advance(ctx, attn, (k_scale, v_scale) if scored else None)
        self.report.seconds += time.perf_counter() - t0

    def finalize(self, state: CompressionState) -> StageReport:
        t0 = time.perf_counter()
        skip = set(self.options.skip_layers)
        if self.online:
            del self.report.details["headroom"], self.report.details["scale_search"]
        if self._sensitivity is not None:
            kl = self._sensitivity.kl(state.model, mapping_for(state.model), state.device)
            windows = int(self._sensitivity.windows.shape[0])
            self._sensitivity = None
            chosen = sorted(kl, key=lambda i: -kl[i])[: self.options.skip_sensitive]
            for name in state.kv_scales:
                if decoder_layer_index(name) in chosen:
                    clear_kv_scale_buffers(state.model.get_submodule(name))
            skip.update(chosen)
            self.report.details["sensitivity"] = {
                "kl_per_layer": {str(i): kl[i] for i in sorted(kl)},
                "windows": windows,
                "chosen": sorted(chosen),
            }
        state.kv_skip_layers = sorted(skip)
        # (int8 / int4 name them apart: the report's skip_layers line is about fp8 and vLLM's flag)
        self.report.details["unquantized_layers" if self.online else "skip_layers"] = (
            state.kv_skip_layers
        )
        if skip and not self.online:
            self.report.details["vllm"] = (
                "--kv-cache-dtype fp8 --kv-cache-dtype-skip-layers "
                + " ".join(map(str, state.kv_skip_layers))
            )
        self.report.seconds += time.perf_counter() - t0
        return self.report


class LayerSensitivity:
    """Each decoder layer's end-to-end cost of fp8 K/V: the mean over the tokens of a few
    calibration windows of KL(p_exact || p_i), where p_i is the next-token distribution with fp8
    K/V in layer i alone and exact K/V everywhere else.

    Built while the stage calibrates the layers one at a time, so it holds no more of the model
    than the calibration does (bounded-memory runs included): the windows' hidden states travel
    through the layers as an exact branch plus one branch per scored layer, branch i starting from
    the exact branch at layer i with fp8 K/V there. Layer j runs every live branch, j + 2 forwards
    of the windows, so L layers cost L(L + 3) / 2 layer forwards (a whole-model forward per layer
    would cost L(L + 1)); the branches' hidden states (L x windows x seq_len x hidden floats) wait
    on the CPU for the final norm and lm_head in `kl`.
    """

    def __init__(self, windows: torch.Tensor):
        self.windows = windows  # [n, seq_len] token ids
        self.exact: torch.Tensor | None = None  # the exact branch's hidden states (CPU)
        self.kwargs: dict | None = None  # the decoder layers' other arguments for these windows
        self.branches: dict[int, torch.Tensor] = {}  # scored layer -> its branch's hidden states

    def advance(self, ctx, attn: nn.Module, scales: tuple[float, float] | None) -> None:
        """Run every branch through layer `ctx.index` (just calibrated) and start its own branch
        when `scales` is given (None: the layer is not scored, and attends exactly); afterwards
        `attn` has those scales, as the stage left it."""
        if self.exact is None:  # layer 0: the windows' inputs, made like the calibration's
            first = capture_first_layer_inputs(
                ctx.state.model, ctx.mapping, [self.windows], ctx.device, ctx.inputs.hidden[0].dtype
            )
            self.exact, self.kwargs = first.hidden[0], first.kwargs[0]
        clear_kv_scale_buffers(attn)
        try:
            order = sorted(self.branches)
            runs = [self.exact] + [self.branches[i] for i in order]
            outs = replay(ctx.layer, LayerInputs(runs, [self.kwargs] * len(runs)), ctx.device)
        finally:
            if scales is not None:
                set_kv_scale_buffers(attn, *scales)
        if scales is not None:
            self.branches[ctx.index] = replay(
                ctx.layer, LayerInputs([self.exact], [self.kwargs]), ctx.device
            )[0]
        self.exact = outs[0]
        for i, h in zip(order, outs[1:]):
            self.branches[i] = h

    def kl(self, model: nn.Module, mapping, device: torch.device) -> dict[int, float]:
        """Scored layer -> mean KL per token (nats), through the model's final norm and lm_head."""
        head = nn.ModuleList(
            [model.get_submodule(mapping.final_norm), model.get_output_embeddings()]
        )
        held = next(head.parameters()).dtype
        out: dict[int, float] = {}
        with (
            torch.no_grad(),
            layer_on_device(head, device, torch.float32 if held != torch.float32 else None),
        ):
            exact = head[1](head[0](self.exact.to(device))).float().log_softmax(-1)
            p = exact.exp()
            for i, h in sorted(self.branches.items()):
                logp = head[1](head[0](h.to(device))).float().log_softmax(-1)
                out[i] = (p * (exact - logp)).sum().item() / (exact.shape[0] * exact.shape[1])
        return out


def candidate_scales(
    absmax: float, headroom: float, steps: int, storage: torch.dtype
) -> list[float]:
    """headroom x absmax / 448 x 2^(j / steps) for j < steps, each rounded to the storage dtype
    (the value the artifact stores, so the one searched is the one served); duplicates dropped."""
    first = kv_scale_from_absmax(absmax) * headroom
    out: list[float] = []
    for j in range(steps):
        s = _round_to(first * 2.0 ** (j / steps), storage)
        if s > 0 and math.isfinite(s) and s not in out:
            out.append(s)
    return out


def search_kv_scales(
    ctx, attn: nn.Module, k_grid: list[float], v_grid: list[float]
) -> tuple[list[float], list[float]]:
    """Summed squared error of the attention output (before o_proj) over the calibration windows,
    for every K scale in `k_grid` (V exact) and every V scale in `v_grid` (K exact), against
    attention over exact K and V. One replay of the layer up to its attention module."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_err, v_err = [0.0] * len(k_grid), [0.0] * len(v_grid)

    def attend(q, k, v, mask, kwargs) -> torch.Tensor:
        return sdpa_attention_forward(attn, q, k, v, mask, **kwargs)[0].float()

    def observe(query, key, value, mask, kwargs):
        with torch.no_grad():
            ref = attend(query, key, value, mask, kwargs)
            for j, s in enumerate(k_grid):
                k_err[j] += (
                    (attend(query, fp8_e4m3_roundtrip(key, s), value, mask, kwargs) - ref)
                    .square()
                    .sum()
                    .item()
                )
            for j, s in enumerate(v_grid):
                v_err[j] += (
                    (attend(query, key, fp8_e4m3_roundtrip(value, s), mask, kwargs) - ref)
                    .square()
                    .sum()
                    .item()
                )

    with observing_attention(attn, observe):
        ctx.forward(stop_after=[attn])
    return k_err, v_err


def _argmin(xs: list[float]) -> int:
    return min(range(len(xs)), key=xs.__getitem__)


def observe_kv_absmax(ctx, attn: nn.Module) -> tuple[float, float]:
    """Absmax over all calibration tokens of the cached K (after k_norm and RoPE) and of V.

    Hooks: a pre-hook on the attention module takes the (cos, sin) it receives; K is read at the
    output of `k_norm` when the module has one (Qwen3), else of k_proj, then rotated; V is v_proj's
    output.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    head_dim = attn.head_dim
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    absmax = {"k": 0.0, "v": 0.0}

    def take_rope(_module, _args, kwargs):
        rope["cos_sin"] = kwargs["position_embeddings"]

    def on_key(_module, _inputs, out):
        b, s = out.shape[:2]
        k = out.reshape(b, s, -1, head_dim).transpose(1, 2)  # [b, kv_heads, s, head_dim]
        cos, sin = rope["cos_sin"]
        k = apply_rotary_pos_emb(k, k, cos, sin)[1]
        absmax["k"] = max(absmax["k"], k.abs().max().item())

    def on_value(_module, _inputs, out):
        absmax["v"] = max(absmax["v"], out.abs().max().item())

    key_source = getattr(attn, "k_norm", None)
    if key_source is None:
        key_source = ctx.module(ctx.mapping.k_proj)
    handles = [
        attn.register_forward_pre_hook(take_rope, with_kwargs=True),
        key_source.register_forward_hook(on_key),
        ctx.module(ctx.mapping.v_proj).register_forward_hook(on_value),
    ]
    try:
        ctx.forward(stop_after=[attn])
    finally:
        for h in handles:
            h.remove()
    return absmax["k"], absmax["v"]


def check_kv_architecture(config) -> None:
    """RecipeError for a model whose K/V this stage cannot observe or attend exactly: Phi-3's
    keys and values come out of one fused qkv_proj (no k_proj / v_proj output to read,
    compress/mappings.py), and soft-capped attention scores (Gemma 2) are not computed by the
    fp8 / int KV attention that the stage evaluates through (runtime/loading/hf_fp8kv.py: it
    calls transformers' sdpa, which takes no cap)."""
    mt = getattr(config, "model_type", None)
    if mt == "phi3":
        raise RecipeError(
            "stages.kv_cache: phi3 computes K and V in one fused qkv_proj, which the stage "
            "does not split yet; leave the stage out for this model"
        )
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise RecipeError(
            f"stages.kv_cache: {mt} soft-caps its attention scores, which the stage's quantized "
            "KV attention does not apply; leave the stage out for this model"
        )


def _round_to(x: float, dtype: torch.dtype) -> float:
    """x rounded to nearest in `dtype` (the value the artifact stores)."""
    return torch.tensor(x, dtype=dtype).item()
