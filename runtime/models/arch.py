"""Which runtime model serves a config.json: `model_spec` reads the shape and `model_class` names
the CausalLM that computes it (runtime/models/llama.py for the Llama family and the mixtures of
experts, runtime/models/gemma.py for Gemma 2 / 3, runtime/models/phi3.py for Phi-3). Every other
model_type is refused by name."""

from __future__ import annotations

from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.models import llama
from slimserve.runtime.models.gemma import GEMMA_MODEL_TYPES, GemmaCausalLM, GemmaSpec, gemma_spec
from slimserve.runtime.models.phi3 import PHI3_MODEL_TYPES, Phi3CausalLM, Phi3Spec, phi3_spec

SUPPORTED_MODEL_TYPES = (*llama.SUPPORTED_MODEL_TYPES, *GEMMA_MODEL_TYPES, *PHI3_MODEL_TYPES)


def model_spec(config) -> llama.ModelSpec:
    """The ModelSpec (or its Gemma / Phi-3 subclass) of a transformers config."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ArtifactError(
            f"config.json: model_type {mt!r} is not supported by the runtime; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if mt in GEMMA_MODEL_TYPES:
        return gemma_spec(config)
    if mt in PHI3_MODEL_TYPES:
        return phi3_spec(config)
    return llama.model_spec(config)


def model_class(spec: llama.ModelSpec) -> type[llama.CausalLM]:
    if isinstance(spec, GemmaSpec):
        return GemmaCausalLM
    if isinstance(spec, Phi3Spec):
        return Phi3CausalLM
    return llama.CausalLM
