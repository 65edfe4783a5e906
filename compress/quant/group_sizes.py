"""Group sizes against Linear input widths, checked before any work (compress/pipeline.py).

A `group` scheme splits each Linear's K input columns into groups of `group_size` columns with
one scale (and zero point) each. When group_size does not divide K, the last group is partial.
Our quantizers, the compressed-tensors codec and both of our loaders handle that (the group count
rounds up: runtime/artifact/qweight.py `num_groups`), but compressed-tensors itself, and so
transformers and vLLM, refuse such a checkpoint ("tensor column shape must be divisible by the
given group_size"), and GPTQ/AWQ loaders need K % group_size == 0 as well. So the pipeline refuses
a partial group before any work, naming the Linears and the group sizes that would divide them,
unless the recipe sets `export.allow_partial_groups: true` for an artifact only slimserve will load;
the manifest then lists the Linears with a partial group (`ArtifactManifest.partial_groups`).

The widths are those of the model each stage will see: a stage that reshapes the model (prune)
returns the config it leaves from `Stage.preflight`, the model that config describes is built on
the meta device (names, classes and shapes, no storage and no weights), and each quantizing stage
names the Linears its scheme groups (`Stage.grouped_linears`).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass

import torch
from torch import nn

from slimserve.compress.errors import UnsupportedModelError
from slimserve.compress.moe import prepare_model
from slimserve.runtime.artifact.qweight import QuantizedWeight
from slimserve.runtime.artifact.scheme import QuantScheme

# Group sizes offered as a fix: powers of two, the sizes vLLM's and transformers' int4 kernels
# take; 8 is the smallest group size a scheme accepts (runtime/artifact/scheme.py).
_MIN_SUGGESTED = 8
_LAYER_INDEX = re.compile(r"\.\d+(?=\.|$)")  # ".12" of "model.layers.12.mlp.up_proj"


def shape_model(config) -> nn.Module:
    """The causal LM `config` describes, on the meta device: module names, classes and shapes only."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config  # shapes of the dense model; no quantizer is involved
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as e:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', None)!r}: transformers "
            f"cannot build it from its config ({e})"
        ) from None
    prepare_model(model)  # stacked experts -> per-expert Linears, as the stages will see them
    return model


@dataclass(frozen=True, slots=True)
class PartialGroups:
    """The Linears of one stage whose input width `group_size` does not divide."""

    group_size: int
    partial: dict[str, int]  # Linear name -> its in_features (not a multiple of group_size)
    widths: tuple[int, ...]  # every distinct in_features the stage groups, ascending

    def modules(self) -> str:
        """The offending Linears, compactly: layer indices become `*`, names sharing a width and a
        prefix are braced: `model.layers.*.{self_attn.q_proj,mlp.up_proj} (in 576)`."""
        by_width: dict[int, list[str]] = {}
        for name, width in self.partial.items():
            pattern = _LAYER_INDEX.sub(".*", name)
            names = by_width.setdefault(width, [])
            if pattern not in names:
                names.append(pattern)
        count = len(self.partial)
        parts = [f"{_brace(names)} (in {width})" for width, names in by_width.items()]
        return f"{count} Linear{'s' if count > 1 else ''}: {', '.join(parts)}"

    def dividing_sizes(self) -> list[int]:
        """Powers of two below group_size that divide every width the stage groups, largest first."""
        sizes, g = [], _MIN_SUGGESTED
        while g < self.group_size:
            if all(w % g == 0 for w in self.widths):
                sizes.append(g)
            g *= 2
        return sizes[::-1]

    def fix(self) -> str:
        """The group sizes that would work: 'use group_size 64 (or 32); 64 divides 576 and 1536'."""
        sizes = self.dividing_sizes()
        widths = _and(self.widths)
        if not sizes:
            return (
                f"no power-of-two group_size of {_MIN_SUGGESTED} or more divides {widths}; use "
                "group_size -1 (one scale per output channel)"
            )
        alt = f" (or {sizes[1]})" if len(sizes) > 1 else ""
        return f"use group_size {sizes[0]}{alt}; {sizes[0]} divides {widths}"


def partial_groups(
    linears: dict[str, nn.Linear], scheme: QuantScheme | None
) -> PartialGroups | None:
    """The Linears of `linears` whose in_features `scheme`'s group size leaves a partial group, or None."""
    w = scheme.weights if scheme is not None else None
    if w is None or w.strategy != "group" or not linears:
        return None
    partial = {n: m.in_features for n, m in linears.items() if m.in_features % w.group_size}
    if not partial:
        return None
    return PartialGroups(
        w.group_size, partial, tuple(sorted({m.in_features for m in linears.values()}))
    )


def partial_group_modules(quantized: dict[str, QuantizedWeight]) -> list[str]:
    """Names of the quantized Linears whose last input group is partial, in model order."""
    return [
        name
        for name, qw in quantized.items()
        if qw.args.strategy == "group" and qw.shape[1] % qw.args.group_size
    ]


def _brace(names: list[str]) -> str:
    """'a.b.{x,y}' for ['a.b.x', 'a.b.y'] (the longest common prefix ending at a dot)."""
    if len(names) == 1:
        return names[0]
    prefix = names[0]
    for n in names[1:]:
        while not n.startswith(prefix):
            prefix = prefix[: prefix.rfind(".", 0, len(prefix) - 1) + 1]
    return f"{prefix}{{{','.join(n[len(prefix) :] for n in names)}}}"


def _and(items) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
