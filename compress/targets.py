"""Which modules a stage touches, by compressed-tensors' `targets` / `ignore` rules (the matching
itself is the artifact's: runtime/artifact/targets.py), the refusal of an entry that matches
nothing, and of targets that mean weights no stage can quantize (stacked expert tensors of an
architecture compress/moe.py does not convert to per-expert Linears). Mixture-of-experts routers
are never selected (compress/moe.py `dense_modules`)."""

from __future__ import annotations

from torch import nn

from slimserve.compress.errors import RecipeError
from slimserve.compress.moe import dense_modules
from slimserve.runtime.artifact.targets import matches
from slimserve.runtime.loading.moe_experts import MOE_LAYOUTS


def select_linears(model: nn.Module, targets: list[str], ignore: list[str]) -> dict[str, nn.Linear]:
    """Linear modules matched by `targets` and not by `ignore`, in model order; never a
    mixture-of-experts router or shared-expert gate, which stay in full precision."""
    dense = dense_modules(model)
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear)
        and name not in dense
        and matches(name, m, targets)
        and not matches(name, m, ignore)
    }


def check_patterns(model: nn.Module, patterns: list[str], what: str) -> None:
    """Refuse a `targets`/`ignore` entry that matches nothing (usually a typo)."""
    modules = list(model.named_modules())
    for p in patterns:
        if not any(matches(n, m, [p]) for n, m in modules):
            raise RecipeError(
                f"{what}: {p!r} matches no module of this model; use a module name "
                "(e.g. lm_head), 're:<regex>' or a class name such as Linear"
            )


def stacked_weights(model: nn.Module) -> dict[str, list[tuple[str, tuple[int, ...]]]]:
    """Modules that hold floating-point weights of 3 or more dimensions, with those weights'
    names and shapes: transformers 5 keeps a mixture-of-experts layer's experts as one module of
    stacked matrices (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]) instead
    of one nn.Linear per expert."""
    found: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            if p.ndim >= 3 and p.is_floating_point():
                found.setdefault(name, []).append((pname, tuple(p.shape)))
    return found


def check_reach(model: nn.Module, targets: list[str], ignore: list[str], stage: str) -> None:
    """Refuse, naming them, the weights `targets` mean that the stage cannot quantize: stacked
    expert matrices, which a `Linear` class target covers (they are linear layers' weights) as
    does a name or regex matching their module. Without this a stage would report success with
    those weights left in full precision. `ignore` listing the module keeps them on purpose."""
    left = [
        (name, weights)
        for name, weights in stacked_weights(model).items()
        if not matches(name, model.get_submodule(name), ignore)
        and ("Linear" in targets or matches(name, model.get_submodule(name), targets))
    ]
    if not left:
        return
    shown = "; ".join(
        f"{name} ({', '.join(f'{p} {list(shape)}' for p, shape in weights)})"
        for name, weights in left[:3]
    )
    more = f" and {len(left) - 3} more" if len(left) > 3 else ""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in MOE_LAYOUTS:
        raise RecipeError(
            f"stages.{stage}: {shown}{more} still hold stacked expert weights; convert the model "
            "to per-expert Linears first (compress/moe.py prepare_model, which run_recipe calls)"
        )
    raise RecipeError(
        f"stages.{stage}: its targets cover {len(left)} module(s) of stacked expert weights that "
        f"it cannot quantize and would leave in full precision: {shown}{more}; experts are "
        f"quantized per expert for {', '.join(sorted(MOE_LAYOUTS))}, not for {model_type!r} "
        "(to keep them unquantized on purpose, add e.g. 're:.*experts$' to the stage's ignore)"
    )
