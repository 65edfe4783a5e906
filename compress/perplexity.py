"""Perplexity over non-overlapping windows of a token stream: the quality gate's measurement.

The stream is cut into windows of `seq_len` tokens (the remainder is dropped); inside each window
the model predicts tokens 1..seq_len-1 from their prefixes, so a result over W windows scores
W * (seq_len - 1) tokens. The loss is computed from the logits upcast to float32 whatever the
model's dtype, and the model itself is never cast or left in a different mode.
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from slimserve.compress.datasets import load_token_documents, parse_dataset
from slimserve.compress.progress import counting_bar

# exp() of a mean NLL above this overflows a float64; such a model is reported as ppl = inf.
_MAX_EXP_ARG = 709.0


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    ppl: float  # exp(nll_mean)
    nll_mean: float  # mean negative log-likelihood per scored token, in nats
    tokens: int  # scored tokens: windows * (seq_len - 1)
    windows: int  # windows evaluated
    seconds: float  # wall time of the forward passes
    dataset: str  # the dataset spec the tokens came from ('' when unknown)
    seq_len: int  # tokens per window

    def to_dict(self) -> dict:
        return asdict(self)


def _model_device(model: torch.nn.Module) -> torch.device:
    device = getattr(model, "device", None)
    if isinstance(device, torch.device):
        return device
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _forward_kwargs(model: torch.nn.Module) -> dict:
    """Turn the KV cache off where the forward accepts `use_cache` (no use for one-shot scoring)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def _logits(out) -> torch.Tensor:
    """Logits from an HF output (`.logits`), a tuple (first item) or a bare tensor. [B, T, V]"""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if logits is None and isinstance(out, (tuple, list)):
        logits = out[0]
    if not isinstance(logits, torch.Tensor):
        raise TypeError(
            f"model output {type(out).__name__} has no logits; the model must return "
            f"a tensor [batch, seq, vocab] or an object with .logits"
        )
    return logits


def _check_args(
    token_ids: torch.Tensor, seq_len: int, max_windows: int | None, batch_size: int
) -> None:
    if token_ids.dim() != 1:
        raise ValueError(
            f"token_ids must be 1-D [num_tokens], got shape {tuple(token_ids.shape)}; flatten it"
        )
    if seq_len < 2:
        raise ValueError(f"seq_len={seq_len} scores no tokens; use seq_len >= 2")
    if max_windows is not None and max_windows < 1:
        raise ValueError(
            f"max_windows={max_windows}; use a positive number or None for every window"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}; use batch_size >= 1")
    if token_ids.numel() < seq_len:
        raise ValueError(
            f"{token_ids.numel()} tokens is fewer than one window of seq_len={seq_len}; "
            f"use a larger dataset or a smaller seq_len"
        )


@torch.no_grad()
def evaluate_perplexity(
    model: torch.nn.Module,
    token_ids: torch.Tensor,
    seq_len: int = 512,
    max_windows: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
    dtype: torch.dtype = torch.float32,
    dataset: str = "",
) -> PerplexityResult:
    """Mean NLL and perplexity of `model` on the first `max_windows` windows of `token_ids` [N].

    `dtype` is the precision of the loss (log-softmax) computation; the model runs in its own dtype.
    """
    windows = eval_windows(token_ids, seq_len, max_windows, batch_size)  # [W, seq_len]
    num_windows = windows.shape[0]
    device, kwargs, was_training = _model_device(model), _forward_kwargs(model), model.training
    model.eval()
    nll_sum = 0.0  # nats, accumulated in float64 on the host
    start = time.perf_counter()
    try:
        with counting_bar("perplexity", progress) as bar:
            task = bar.add_task("perplexity", total=num_windows)
            for i in range(0, num_windows, batch_size):
                batch = windows[i : i + batch_size].to(device)  # [B, seq_len]
                logits = _logits(model(input_ids=batch, **kwargs))  # [B, seq_len, V]
                nll_sum += window_nll(logits, batch, dtype)
                bar.advance(task, batch.size(0))
    finally:
        model.train(was_training)
    return perplexity_result(nll_sum, num_windows, seq_len, time.perf_counter() - start, dataset)


def eval_windows(
    token_ids: torch.Tensor, seq_len: int, max_windows: int | None, batch_size: int
) -> torch.Tensor:
    """The first `max_windows` non-overlapping windows of `token_ids` [N], as [W, seq_len] int64."""
    _check_args(token_ids, seq_len, max_windows, batch_size)
    num_windows = token_ids.numel() // seq_len
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    return token_ids[: num_windows * seq_len].view(num_windows, seq_len).long()


def window_nll(
    logits: torch.Tensor, batch: torch.Tensor, dtype: torch.dtype = torch.float32
) -> float:
    """Summed NLL (nats) of windows `batch` [B, T] under `logits` [B, T, V]: position t predicts t+1."""
    pred = logits[:, :-1].to(dtype)  # [B, T-1, V]
    return F.cross_entropy(
        pred.reshape(-1, pred.size(-1)), batch[:, 1:].reshape(-1), reduction="sum"
    ).item()


def perplexity_result(
    nll_sum: float, num_windows: int, seq_len: int, seconds: float, dataset: str = ""
) -> PerplexityResult:
    tokens = num_windows * (seq_len - 1)
    nll_mean = nll_sum / tokens
    ppl = math.exp(nll_mean) if nll_mean < _MAX_EXP_ARG else math.inf
    return PerplexityResult(ppl, nll_mean, tokens, num_windows, seconds, dataset, seq_len)


def perplexity_on(
    model: torch.nn.Module,
    tokenizer,
    dataset_spec,
    seq_len: int = 512,
    max_windows: int | None = None,
    batch_size: int = 8,
    progress: bool = True,
) -> PerplexityResult:
    """Encode a dataset (spec string or `DatasetSpec`; named corpora: their eval split) and score it."""
    spec = parse_dataset(dataset_spec) if isinstance(dataset_spec, str) else dataset_spec
    token_ids = load_token_documents(spec, tokenizer)  # [num_tokens]
    return evaluate_perplexity(
        model, token_ids, seq_len, max_windows, batch_size, progress, dataset=str(spec)
    )
