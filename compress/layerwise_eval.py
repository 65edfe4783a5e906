"""Perplexity with one decoder layer on the device at a time, for models larger than it.

The same computation as perplexity.evaluate_perplexity (same windows, same ops, same loss),
reordered: every evaluation window's hidden states pass layer 0, then layer 1, ... (kept on the
CPU between layers: windows x seq_len x hidden x 4 bytes), then the final norm and lm_head run
batch by batch on the device. `perplexity_on_device` (the pipeline's and `compress eval`'s
measurement) uses it when the whole float32 model does not fit on the device.

`model_perplexity` (`compress eval`) goes one step further when the float32 model does not fit
in host memory either: a local unquantized safetensors checkpoint is read as a skeleton
(runtime/loading/loader.py `load_skeleton`) and each decoder layer comes from disk just before its turn
(compress/layer_store.py), so the host holds one layer, not the model.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from torch import nn

from slimserve.compress.calibration import capture_first_layer_inputs, layer_on_device, move_trunk
from slimserve.compress.layer_store import LayerStore
from slimserve.compress.mappings import ARCHITECTURES, decoder_layers, mapping_for
from slimserve.compress.perplexity import (
    PerplexityResult,
    eval_windows,
    evaluate_perplexity,
    perplexity_result,
    window_nll,
)
from slimserve.compress.progress import counting_bar
from slimserve.compress.stage import LayerInputs, replay
from slimserve.runtime.artifact.importers import read_quant_config
from slimserve.runtime.errors import ArtifactError
from slimserve.runtime.loading.gguf import resolve_model
from slimserve.runtime.loading.lazy_weights import CheckpointTensors, available_memory
from slimserve.runtime.loading.loader import load_config, load_model, load_skeleton

MEMORY_MODES = ("auto", "layers", "whole")  # model_perplexity(memory=)


class LayerReader(Protocol):
    """Decoder layers held outside the model (compress/layer_store.py `LayerStore`)."""

    def load(self, i: int) -> nn.Module: ...  # layer i with real tensors in float32

    def drop(self, i: int) -> None: ...  # release layer i unchanged


@torch.no_grad()
def layerwise_perplexity(
    model: nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    max_windows: int | None,
    batch_size: int,
    device: torch.device,
    progress: bool = False,
    dtype: torch.dtype = torch.float32,
    dataset: str = "",
    layers: LayerReader | None = None,
) -> PerplexityResult:
    """Perplexity with one decoder layer at a time on `device`; with `layers`, each decoder layer
    is read from it just before its turn and released after (the model holds skeletons), and the
    trunk (embeddings, final norm, lm_head) computes in float32 whatever dtype it is held in."""
    start = time.perf_counter()
    windows = eval_windows(token_ids, seq_len, max_windows, batch_size)
    batches = list(windows.split(batch_size))
    mapping, was_training = mapping_for(model), model.training
    model.eval()
    stack = decoder_layers(model, mapping)
    compute = torch.float32 if layers is not None else None
    try:
        with counting_bar("perplexity layers", progress) as bar:
            task = bar.add_task("layers", total=len(stack) + 1)
            inputs = capture_first_layer_inputs(model, mapping, batches, device, compute)
            for i in range(len(stack)):
                layer = layers.load(i) if layers is not None else stack[i]
                with layer_on_device(layer, device, None):
                    inputs = LayerInputs(replay(layer, inputs, device), inputs.kwargs)
                if layers is not None:
                    layers.drop(i)
                bar.advance(task)
            head = nn.ModuleList(
                [model.get_submodule(mapping.final_norm), model.get_output_embeddings()]
            )
            held = next(head.parameters()).dtype
            nll_sum = 0.0
            with layer_on_device(head, device, compute if held != compute else None):
                for h, batch in zip(inputs.hidden, batches):
                    logits = head[1](head[0](h.to(device)))
                    nll_sum += window_nll(logits, batch.to(device), dtype)
            bar.advance(task)
    finally:
        move_trunk(model, mapping.layers, torch.device("cpu"))
        model.train(was_training)
    return perplexity_result(
        nll_sum, windows.shape[0], seq_len, time.perf_counter() - start, dataset
    )


def whole_model_shortfall(model: nn.Module, device: torch.device, batch_tokens: int) -> str:
    """Why the whole model cannot be evaluated on `device` ('' when it can, always on the CPU):
    its weights plus ~3 float32 copies of a batch's logits must fit in 90% of the free memory."""
    if device.type != "cuda":
        return ""
    free, _ = torch.cuda.mem_get_info(device)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    need = weights + 3 * 4 * batch_tokens * model.config.vocab_size
    return (
        "" if need < 0.9 * free else f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"
    )


@contextmanager
def model_on(model: nn.Module, device: torch.device):
    """The whole model on `device` for the block (perplexity), then back on the CPU."""
    if device.type == "cpu":
        yield
        return
    model.to(device)
    try:
        yield
    finally:
        model.to("cpu")


def perplexity_on_device(
    model: nn.Module,
    token_ids: torch.Tensor,
    seq_len: int,
    max_windows: int | None,
    batch_size: int,
    device: torch.device,
    progress: bool = False,
    note: Callable[[str], None] = lambda m: None,
    layers: LayerReader | None = None,
) -> PerplexityResult:
    """evaluate_perplexity with the whole model on `device` when it fits there, else layer by
    layer (the same number); the model is back on the CPU afterwards. With `layers` (the model
    holds no decoder layer: compress/layer_store.py) always layer by layer, reading each from it."""
    if layers is not None:
        return layerwise_perplexity(
            model, token_ids, seq_len, max_windows, batch_size, device, progress, layers=layers
        )
    short = whole_model_shortfall(model, device, batch_size * seq_len)
    if short:
        note(f"the whole model does not fit on {device} ({short}): evaluating layer by layer")
        return layerwise_perplexity(
            model, token_ids, seq_len, max_windows, batch_size, device, progress
        )
    with model_on(model, device):
        return evaluate_perplexity(
            model, token_ids, seq_len, max_windows, batch_size, progress=progress
        )


def layers_plan(source: str, memory: str, config=None) -> str:
    """Why `model_perplexity` holds the whole model in float32 ('' when it reads one decoder
    layer at a time): "whole" asked for, not a local folder, quantized, an architecture without a
    layer mapping (`config`: the folder's, read by the caller), or (memory "auto") a float32
    model that fits in 90% of available memory."""
    if memory == "whole":
        return "memory 'whole' was asked for"
    path = Path(source)
    if not path.is_dir():
        return f"{source} is not a local checkpoint folder"
    if read_quant_config(path):
        return f"{source} is quantized (layer-by-layer reading takes unquantized checkpoints)"
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return f"architecture {getattr(config, 'model_type', None)!r} has no layer mapping (compress/mappings.py)"
    if memory == "auto":
        need, free = 4 * _checkpoint_params(path), available_memory()
        if free is None or need <= 0.9 * free:
            return "the float32 model fits in memory"
    return ""


def _checkpoint_params(path: Path) -> int:
    """Elements of the folder's weight files, from their headers (no tensor is read)."""
    return sum(math.prod(e.shape) for e in CheckpointTensors(path).entries.values())


def model_perplexity(
    source: str,
    tokens: Callable[[object], torch.Tensor],
    seq_len: int,
    max_windows: int | None,
    batch_size: int,
    device: torch.device,
    *,
    memory: str = "auto",
    verify: str = "strict",
    trust_remote_code: bool = False,
    progress: bool = False,
    note: Callable[[str], None] = lambda m: None,
) -> PerplexityResult:
    """Perplexity of a model or artifact (`compress eval`). memory: "layers" reads a local
    unquantized checkpoint's decoder layers one at a time (an error says why it cannot), "whole"
    loads the float32 model, "auto" the first only when the second would not fit in memory.
    tokens(tokenizer) -> the evaluation token ids. Both paths give the same number."""
    if memory not in MEMORY_MODES:
        raise ValueError(f"--memory {memory!r}: use one of {', '.join(MEMORY_MODES)}")
    source = resolve_model(source)
    config = (
        load_config(source, trust_remote_code)
        if memory != "whole" and Path(source).is_dir()
        else None
    )
    why_whole = layers_plan(source, memory, config)
    if why_whole and memory == "layers":
        raise ArtifactError(
            f"{source} cannot be evaluated layer by layer: {why_whole}; use --memory whole"
        )
    if not why_whole:
        mapping = ARCHITECTURES[config.model_type]
        skeleton = load_skeleton(source, mapping.layers, verify, trust_remote_code)
        note(f"memory: decoder layers are read from {source} one at a time")
        store = LayerStore(skeleton.model, mapping, skeleton.checkpoint, {})
        try:
            return perplexity_on_device(
                skeleton.model,
                tokens(skeleton.tokenizer),
                seq_len,
                max_windows,
                batch_size,
                device,
                progress,
                note,
                layers=store,
            )
        finally:
            store.close()
    loaded = load_model(
        source, dtype=torch.float32, trust_remote_code=trust_remote_code, verify=verify
    )
    return perplexity_on_device(
        loaded.model,
        tokens(loaded.tokenizer),
        seq_len,
        max_windows,
        batch_size,
        device,
        progress,
        note,
    )
