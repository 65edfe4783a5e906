"""The explicit registry of stages (docs/architecture.md, "A new stage"): name -> (options model,
stage class).

Only stages that exist are listed; a recipe naming another one is refused with this list.
"""

from __future__ import annotations

from slimserve.compress.distill.stages import DistillOptions, DistillStage
from slimserve.compress.prune.stages import PruneOptions, PruneStage
from slimserve.compress.quant.awq_stage import AwqOptions, AwqStage
from slimserve.compress.quant.gptq_stage import GptqOptions, GptqStage
from slimserve.compress.quant.kv_cache import KvCacheOptions, KvCacheStage
from slimserve.compress.quant.smoothquant_stage import SmoothQuantOptions, SmoothQuantStage
from slimserve.compress.quant.stages import RtnOptions, RtnStage

STAGES = {
    "prune": (PruneOptions, PruneStage),
    "distill": (DistillOptions, DistillStage),
    "rtn": (RtnOptions, RtnStage),
    "gptq": (GptqOptions, GptqStage),
    "awq": (AwqOptions, AwqStage),
    "smoothquant": (SmoothQuantOptions, SmoothQuantStage),
    "kv_cache": (KvCacheOptions, KvCacheStage),
}
STAGE_SPECS = {name: spec for name, (spec, _) in STAGES.items()}
