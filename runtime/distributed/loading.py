"""One rank's model: what `build_model` (runtime/models/load.py) asks of a tensor-parallel shard.

`build_model(..., shard=TensorShard(group))` builds the CausalLM with the rank's shapes
(`local_spec`), reads only the rank's slices (`read`, runtime/distributed/sharding.py), gives
act-order row-parallel QuantLinears their full group count (`after_replace`), and once the
weights are loaded and fused wraps the layers that communicate (`parallelize`,
runtime/distributed/layers.py). Only rank 0 loads the tokenizer.
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from slimserve.runtime.distributed.group import TPGroup
from slimserve.runtime.distributed.layers import parallelize
from slimserve.runtime.distributed.sharding import ShardRanges, ShardReader, local_spec
from slimserve.runtime.layers.quant_linear import QuantLinear
from slimserve.runtime.models.llama import ModelSpec


class TensorShard:
    def __init__(self, group: TPGroup, rename=None):
        """rename: see `ShardReader` (a pipeline stage's tensors under local names)."""
        self.group, self.rename = group, rename
        self.rank, self.world = group.rank, group.world
        self._reader: ShardReader | None = None
        self._ranges: ShardRanges | None = None

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        self._ranges = ShardRanges(spec, self.rank, self.world)
        return local_spec(spec, self.world)

    def read(self, path: Path, model: nn.Module) -> dict:
        self._reader = ShardReader(path, self._ranges, self.rename)
        return self._reader.read()

    def after_replace(self, model: nn.Module) -> None:
        for name, groups in self._reader.full_groups.items():
            old = model.get_submodule(name)
            if isinstance(old, QuantLinear):
                model.set_submodule(
                    name,
                    QuantLinear(
                        old.in_features,
                        old.out_features,
                        old.bias is not None,
                        old.scheme,
                        old.ct_format,
                        dtype=old.weight_scale.dtype,
                        device=old.weight_scale.device,
                        num_groups=groups,
                    ),
                )

    def parallelize(self, model: nn.Module) -> None:
        parallelize(model, self.group, self._ranges)
