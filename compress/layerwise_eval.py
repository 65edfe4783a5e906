"""Perplexity with one decoder layer on the device at a time, for models larger than it.

The same computation as eval.perplexity.evaluate_perplexity (same windows, same ops, same loss),
reordered: every evaluation window's hidden states pass layer 0, then layer 1, ... (kept on the
CPU between layers: windows x seq_len x hidden x 4 bytes), then the final norm and lm_head run
batch by batch on the device. The pipeline uses it when the whole float32 model does not fit.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from slimserve.compress.calibration import LayerInputs, _on_device, _to, capture_first_layer_inputs
from slimserve.compress.quant.mappings import decoder_layers, mapping_for
from slimserve.eval.perplexity import PerplexityResult, eval_windows, perplexity_result, window_nll


@torch.no_grad()
def layerwise_perplexity(model: nn.Module, token_ids: torch.Tensor, seq_len: int, max_windows: int | None,
                         batch_size: int, device: torch.device, progress: bool = False,
                         dtype: torch.dtype = torch.float32, dataset: str = "") -> PerplexityResult:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    start = time.perf_counter()
    windows = eval_windows(token_ids, seq_len, max_windows, batch_size)
    batches = list(windows.split(batch_size))
    mapping, was_training = mapping_for(model), model.training
    model.eval()
    layers = decoder_layers(model, mapping)
    columns = (TextColumn("perplexity layers"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
    try:
        with Progress(*columns, disable=not progress, transient=True) as bar:
            task = bar.add_task("layers", total=len(layers) + 1)
            inputs = capture_first_layer_inputs(model, mapping, batches, device)
            for layer in layers:
                with _on_device(layer, device, None):
                    hidden = [_first(layer(h.to(device), **_to(kw, device))).cpu()
                              for h, kw in zip(inputs.hidden, inputs.kwargs)]
                inputs = LayerInputs(hidden, inputs.kwargs)
                bar.advance(task)
            head = nn.ModuleList([model.get_submodule(mapping.final_norm), model.get_output_embeddings()])
            nll_sum = 0.0
            with _on_device(head, device, None):
                for h, batch in zip(inputs.hidden, batches):
                    logits = head[1](head[0](h.to(device)))
                    nll_sum += window_nll(logits, batch.to(device), dtype)
            bar.advance(task)
    finally:
        _move_trunk_to_cpu(model, mapping.layers)
        model.train(was_training)
    return perplexity_result(nll_sum, windows.shape[0], seq_len, time.perf_counter() - start, dataset)


def _first(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _move_trunk_to_cpu(model: nn.Module, layers_path: str) -> None:
    from slimserve.compress.calibration import _move_outside_layers

    _move_outside_layers(model, layers_path, torch.device("cpu"))
