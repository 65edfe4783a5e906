"""Megatron-style sharding rules, the size checks, and each rank's read of its own slices.

Rank r of N holds (docs/architecture.md, "Tensor parallelism"):

| module | split | rank r's part |
|---|---|---|
| `q_proj` | column (output rows) | query heads [r h/N, (r+1) h/N) |
| `k_proj`, `v_proj` | column | KV heads [r kv/N, (r+1) kv/N); when kv < N, the one KV head its query heads read (replicated N/kv times) |
| `gate_proj`, `up_proj` | column | intermediate rows [r I/N, (r+1) I/N) |
| `qkv_proj`, `gate_up_proj` fused on disk (Phi-3) | column | each part's rows as above, read part by part and stacked: [q_r; k_r; v_r], [gate_r; up_r] |
| full-width `q_norm`, `k_norm` (OLMoE: over heads x head_dim) | with q_proj, k_proj | the weights of the rank's heads; the sums of squares are all-reduced (runtime/distributed/layers.py) |
| `o_proj`, `down_proj` | row (input columns) | the same heads / intermediate columns; rank 0 alone adds the bias |
| each expert's `gate_proj`/`up_proj` (Mixtral `w1`/`w3`), `down_proj` (`w2`), the shared expert's | column, row | the expert's intermediate rows / columns [r I_e/N, (r+1) I_e/N): every rank holds every expert, a slice of each; one all-reduce per MoE block |
| the router `gate`, `shared_expert_gate` | replicated | everything |
| `embed_tokens`, `lm_head` | vocabulary rows | [r s, (r+1) s) with s = ceil(V/N), the last shard zero-padded |
| other norms (per head, per layer), K/V scales | replicated | everything |

Quantized tensors are split on their own boundaries, in the file's layout: each dimension of a
tensor is tagged as following the Linear's output (N) or input (K) dimension, and a rank takes
the proportional part of it: packed int32 words (8 int4 codes each), quantization groups, or plain
rows. So CT `weight_packed` [N, K*b/32], `weight_scale` / `weight_zero_point` [N(packed), G] and
GPTQ / AWQ `qweight`, `qzeros`, `scales` [K(packed), N(packed)] all shard before the GPTQ/AWQ
import (runtime/artifact/importers.py), which then sees an ordinary, smaller checkpoint. A
row-parallel layer's default g_idx (k // group) is rebased to its slice; an act-order g_idx
(any other permutation) keeps every group's scales and zero points on every rank and only the
g_idx is sliced (its values index the full groups; `QuantLinear(num_groups=)`).

`check_tensor_parallel` refuses, from config.json alone and before anything is loaded, a size that
does not divide the heads, splits a GQA group, splits a quantization group or an int32 word of
packed codes, naming the sizes. `read_shard` opens each safetensors file with `safe_open` and
reads only this rank's slice of each tensor (`get_slice`): no rank holds a full copy.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch
from safetensors import safe_open

from slimserve.runtime.artifact.weights import weight_files
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.models.llama import ModelSpec

ROW = ("o_proj", "down_proj")
# each dimension of a tensor follows the Linear's output (N) or input (K) features
LAYOUTS = {
    "weight": "NK",
    "bias": "N",  # dense, and CT naive/int-quantized int8 codes [N, K]
    "weight_packed": "NK",
    "weight_scale": "NK",
    "weight_zero_point": "NK",
    "weight_g_idx": "K",  # CT
    "qweight": "KN",
    "qzeros": "KN",
    "scales": "KN",
    "g_idx": "K",  # GPTQ [K*b/32, N], AWQ [K, N/8]
}
G_IDX = ("weight_g_idx", "g_idx")
GROUPED = (
    "weight_scale",
    "weight_zero_point",
    "qzeros",
    "scales",
)  # their K dimension counts groups


def _fail(msg: str) -> None:
    raise ValueError(f"tensor_parallel_size: {msg}")


def local_kv_heads(spec: ModelSpec, world: int) -> int:
    return max(1, spec.num_kv_heads // world)


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """The shapes one rank's model has (hidden size, layers and RoPE are unchanged)."""
    moe = spec.moe
    if moe is not None:  # every rank holds every expert, a slice of each one's FFN
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // world,
            shared_intermediate_size=moe.shared_intermediate_size // world,
        )
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // world,
        num_kv_heads=local_kv_heads(spec, world),
        intermediate_size=spec.intermediate_size // world,
        vocab_size=-(-spec.vocab_size // world),
        moe=moe,
    )


def _quant_args(qc: dict | None) -> list[tuple[int, int | None, bool, bool]]:
    """(bits, group_size or None, packs along N, packs along K) of every weight scheme in the
    quant config: GPTQ packs codes along K and zero points along N, AWQ both along N, CT
    pack-quantized codes along K and asymmetric zero points along N."""
    if not qc:
        return []
    method = qc.get("quant_method")
    if method == "gptq":
        out = []
        for p in [qc, *(o for o in (qc.get("dynamic") or {}).values() if isinstance(o, dict))]:
            g = p.get("group_size", qc.get("group_size", 128))
            out.append(
                (
                    int(p.get("bits", qc.get("bits", 4))),
                    None if g in (None, -1) else int(g),
                    True,
                    True,
                )
            )
        return out
    if method == "awq":
        g = qc.get("group_size", qc.get("q_group_size", 128))
        return [(4, None if g in (None, -1) else int(g), True, False)]
    out = []
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        g = w.get("group_size") if w.get("strategy") == "group" else None
        packed = (group.get("format") or qc.get("format")) == "pack-quantized"
        out.append((int(w.get("num_bits", 8)), g, packed and not w.get("symmetric", True), packed))
    return out


def check_tensor_parallel(spec: ModelSpec, world: int, qc: dict | None) -> None:
    """ValueError (one line naming the sizes) when `world` ranks cannot split this model."""
    if world < 1:
        _fail(f"{world} is not a size; give 1 or more")
    if world == 1:
        return
    h, kv, d = spec.num_heads, spec.num_kv_heads, spec.head_dim
    if h % world:
        _fail(f"{world} does not divide num_attention_heads {h}; use a divisor of {h}")
    if kv % world and world % kv:
        _fail(
            f"{world} splits the {kv} KV heads unevenly (num_key_value_heads {kv} and "
            f"{world} must divide one another)"
        )
    if spec.intermediate_size % world:
        _fail(f"{world} does not divide intermediate_size {spec.intermediate_size}")
    row = {
        "o_proj (num_attention_heads x head_dim)": h * d,
        "down_proj (intermediate_size)": spec.intermediate_size,
    }
    col = {
        "q_proj": h // world * d,
        "k_proj/v_proj": local_kv_heads(spec, world) * d,
        "gate_proj/up_proj": spec.intermediate_size // world,
    }
    for what, size in _expert_sizes(spec):
        if size % world:
            _fail(f"{world} does not divide the {what} {size}")
        row[f"down_proj ({what})"] = size
        col[f"gate_proj/up_proj ({what})"] = size // world
    for bits, group, packs_n, packs_k in _quant_args(qc):
        for name, width in row.items():
            if group is not None and (width // world) % group:
                _fail(
                    f"{world} splits the quantization groups of {name}: {width} / {world} = "
                    f"{width // world} input columns per rank is not a multiple of group_size "
                    f"{group}; use a size that keeps whole groups"
                )
            if packs_k and (width // world) * bits % 32:
                _fail(
                    f"{world} splits the packed {bits}-bit words of {name}: {width // world} input "
                    "columns per rank do not fill whole int32 words"
                )
        for name, width in col.items():
            if packs_n and width * bits % 32:
                _fail(
                    f"{world} splits the packed {bits}-bit words of {name}: {width} output rows "
                    "per rank do not fill whole int32 words"
                )
    if spec.vocab_size % world and _lm_head_quantized(
        qc
    ):  # a quantized lm_head cannot be zero-padded
        _fail(f"{world} does not divide vocab_size {spec.vocab_size} of a quantized lm_head")


def _expert_sizes(spec: ModelSpec) -> list[tuple[str, int]]:
    """(config key, size) of the FFN widths a MoE model's experts split along."""
    moe = spec.moe
    if moe is None:
        return []
    out = [("experts' intermediate size", moe.intermediate_size)]
    if moe.shared_intermediate_size:
        out.append(("shared expert's intermediate size", moe.shared_intermediate_size))
    return out


def _lm_head_quantized(qc: dict | None) -> bool:
    if (
        not qc
        or qc.get("quant_method") != "compressed-tensors"
        or "lm_head" in (qc.get("ignore") or [])
    ):
        return False  # GPTQ and AWQ leave lm_head dense
    targets = [
        str(t) for g in (qc.get("config_groups") or {}).values() for t in g.get("targets") or []
    ]
    return any(
        t in ("Linear", "lm_head") or (t.startswith("re:") and re.match(t[3:], "lm_head"))
        for t in targets
    )


@dataclasses.dataclass
class ShardRanges:
    """Rank `rank` of `world`: the full-model ranges it holds."""

    spec: ModelSpec
    rank: int
    world: int

    def vocab(self) -> tuple[int, int, int]:
        """(start, stop, shard rows): rows [start, stop) of the vocabulary, padded to `rows`."""
        s = -(-self.spec.vocab_size // self.world)
        start = min(self.rank * s, self.spec.vocab_size)
        return start, min(start + s, self.spec.vocab_size), s

    def module(
        self, leaf: str, module: str = ""
    ) -> tuple[str, tuple[tuple[int, int], ...], int, int] | None:
        """(split 'N' | 'K', the ranges it holds along that dimension, full N, full K) of a
        decoder Linear (or full-width q/k norm) named `module` (its last part `leaf`); None:
        replicated. Several ranges: a Linear fused on disk, its parts' slices stacked."""
        sp = self.spec
        hid = sp.hidden_size
        if sp.moe is not None and ".experts." in module:
            inter = sp.moe.intermediate_size
            leaf = _EXPERT_LEAVES.get(leaf, leaf)
        elif sp.moe is not None and ".shared_expert." in module:
            inter = sp.moe.shared_intermediate_size
        else:
            inter = sp.intermediate_size
        q, kv = self._heads()
        if sp.qk_norm_full and leaf in ("q_norm", "k_norm"):
            leaf = "q_proj" if leaf == "q_norm" else "k_proj"
        if leaf == "q_proj":
            return "N", (q,), sp.num_heads * sp.head_dim, hid
        if leaf in ("k_proj", "v_proj"):
            return "N", (kv,), sp.num_kv_heads * sp.head_dim, hid
        if leaf == "qkv_proj":  # [q; k; v] rows (Phi-3)
            nq, nkv = sp.num_heads * sp.head_dim, sp.num_kv_heads * sp.head_dim
            parts = (q, _shift(kv, nq), _shift(kv, nq + nkv))
            return "N", parts, nq + 2 * nkv, hid
        mine = (self.rank * inter // self.world, (self.rank + 1) * inter // self.world)
        if leaf in ("gate_proj", "up_proj"):
            return "N", (mine,), inter, hid
        if leaf == "gate_up_proj" and ".experts." not in module:  # [gate; up] rows (Phi-3)
            return "N", (mine, _shift(mine, inter)), 2 * inter, hid
        if leaf == "o_proj":
            return "K", (q,), hid, sp.num_heads * sp.head_dim
        if leaf == "down_proj":
            return "K", (mine,), hid, inter
        if leaf == "lm_head":
            start, stop, _ = self.vocab()
            return "N", ((start, stop),), sp.vocab_size, hid
        return None

    def _heads(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """The rows of q_proj and of k_proj / v_proj this rank holds: its query heads, and its
        KV heads (when kv < N, the one KV head its query heads read, replicated N/kv times)."""
        sp, r, w = self.spec, self.rank, self.world
        h, kv, d = sp.num_heads, sp.num_kv_heads, sp.head_dim
        q = (r * h // w * d, (r + 1) * h // w * d)
        if kv >= w:
            return q, (r * kv // w * d, (r + 1) * kv // w * d)
        j = r // (w // kv)
        return q, (j * d, (j + 1) * d)

    def holds_kv_first(self) -> bool:
        """Whether this rank is the first of the ranks holding its KV heads (all are, unless
        kv < N replicates each KV head over N/kv ranks)."""
        kv, w = self.spec.num_kv_heads, self.world
        return kv >= w or self.rank % (w // kv) == 0


def _shift(rng: tuple[int, int], by: int) -> tuple[int, int]:
    return rng[0] + by, rng[1] + by


# Mixtral's expert Linears, by the role they share with the dense names
_EXPERT_LEAVES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _proportional(size: int, rng: tuple[int, int], full: int, name: str) -> slice:
    a, b = rng
    if (a * size) % full or (b * size) % full:
        raise ArtifactError(
            f"{name}: its dimension of {size} cannot be split at [{a}, {b}) of {full}; "
            "the artifact's layout does not match its config.json"
        )
    return slice(a * size // full, b * size // full)


class ShardReader:
    """This rank's slices of every tensor of an artifact, read with safetensors' `get_slice`."""

    def __init__(self, path: Path, ranges: ShardRanges, rename=None):
        """rename: tensor name -> the name this rank loads it as, or None to skip it (a pipeline
        stage's layers, runtime/distributed/pipeline.py); default: every tensor, as named."""
        self.path, self.ranges = path, ranges
        self.rename = rename or (lambda name: name)
        self.full_groups: dict[
            str, int
        ] = {}  # act-order row-parallel module (as loaded) -> its group count

    def read(self) -> dict[str, torch.Tensor]:
        handles = [
            safe_open(str(self.path / f), framework="pt", device="cpu")
            for f in weight_files(self.path)
        ]
        where: dict[str, object] = {}
        for h in handles:
            for name in h.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                if name in where:
                    raise ArtifactError(f"tensor {name} appears in more than one weight file")
                if self.rename(name) is not None:
                    where[name] = h
        g_idx = self._row_g_idx(where)
        return {
            self.rename(name): self._slice(name, h.get_slice(name), g_idx)
            for name, h in where.items()
        }

    def _row_g_idx(self, where: dict) -> dict[str, tuple[torch.Tensor, bool]]:
        """Row-parallel module -> (its full g_idx [K], whether it is the default k // group)."""
        out = {}
        for name, h in where.items():
            module, _, kind = name.rpartition(".")
            leaf = module.rpartition(".")[2]
            if ".experts." in module:
                leaf = _EXPERT_LEAVES.get(leaf, leaf)
            if kind not in G_IDX or leaf not in ROW:
                continue
            raw = h.get_tensor(name)
            g = raw.long()
            scale_name = f"{module}.{'weight_scale' if kind == 'weight_g_idx' else 'scales'}"
            shape = (
                where[scale_name].get_slice(scale_name).get_shape() if scale_name in where else None
            )
            groups = (
                (shape[1] if kind == "weight_g_idx" else shape[0])
                if shape and len(shape) == 2
                else 1
            )
            k = g.numel()
            default = k % groups == 0 and torch.equal(g, torch.arange(k) // (k // groups))
            out[module] = (raw, default)
            if not default:
                self.full_groups[self.rename(name).rpartition(".")[0]] = groups
        return out

    def _slice(self, name: str, sl, g_idx: dict) -> torch.Tensor:
        rg = self.ranges
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        shape = sl.get_shape()
        if module == "model.embed_tokens" or (
            leaf == "lm_head"
            and kind == "weight"
            and len(shape) == 2
            and shape[0] == rg.spec.vocab_size
            and shape[1] == rg.spec.hidden_size
        ):
            start, stop, rows = rg.vocab()
            t = sl[start:stop]
            if t.shape[0] < rows:  # the last shard of a vocabulary N does not divide
                t = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])
            return t
        plan = rg.module(leaf, module)
        if plan is None or (kind not in LAYOUTS and kind != "weight_shape"):
            return sl[:]  # replicated (norms, K/V scales, unknown extras)
        split, ranges, n_full, k_full = plan
        if kind == "bias" and split == "K":  # row-parallel: added once, after the all-reduce
            t = sl[:]
            return t if rg.rank == 0 else torch.zeros_like(t)
        if kind in G_IDX and split == "K":
            g, default = g_idx[module]
            ((a, b),) = ranges  # a row-parallel Linear holds one range of its input
            part = g[a:b].clone()
            if default and part.numel():  # rebased to the slice's own groups
                part -= part[0].clone()
            return part
        held = sum(b - a for a, b in ranges)
        if kind == "weight_shape":
            return torch.tensor(
                [held if split == "N" else n_full, held if split == "K" else k_full],
                dtype=torch.int64,
            )
        tags = LAYOUTS[kind]
        index, cut = [], None  # cut: the dimension split along, and its slice per range
        for dim, size in enumerate(shape):
            tag = tags[dim] if dim < len(tags) else "-"
            if (
                tag != split
                or size == 1
                or (split == "K" and kind in GROUPED and module in self.full_groups)
            ):
                index.append(slice(None))
            else:
                full = n_full if split == "N" else k_full
                cut = dim, [_proportional(size, rng, full, name) for rng in ranges]
                index.append(None)
        if cut is None:
            return sl[tuple(index)]
        dim, pieces = cut
        parts = [sl[tuple(p if i == dim else ix for i, ix in enumerate(index))] for p in pieces]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim)
