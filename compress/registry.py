"""The explicit registry of stages (design.md §4.7): name -> (options model, stage class).

Only stages that exist are listed; a recipe naming another one is refused with this list.
"""

from __future__ import annotations

from slimserve.compress.quant.stages import RtnOptions, RtnStage

STAGES = {
    "rtn": (RtnOptions, RtnStage),
}
STAGE_SPECS = {name: spec for name, (spec, _) in STAGES.items()}
